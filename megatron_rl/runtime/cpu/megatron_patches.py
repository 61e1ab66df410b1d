"""Make Megatron-Core run on CPU with gloo. Activated only when the device is CPU.

Megatron-Core assumes CUDA in places that have nothing to do with the math: it allocates with
`device="cuda"` or `device=torch.cuda.current_device()`, asserts `param.type() ==
'torch.cuda.FloatTensor'`, keeps its RNG tracker in CUDA generators, orders work with CUDA
streams/events, and uses collectives gloo lacks. Each item below names the Megatron-Core 0.16.1
behaviour it redirects (measured list: `docs/architecture.md`, "CPU compatibility layer"):

 1. RNG tracker state lives in the CPU generator (`torch.cuda.{get,set}_rng_state`, `manual_seed`
    and `tensor_parallel.random._{get,set}_cuda_rng_state`).
 2. `torch.cuda.current_device()` returns "cpu" (~110 call sites pass it as `device=`), and
    literal `device="cuda"`, `.cuda()` and `.to("cuda")` are redirected to CPU by a
    `TorchFunctionMode` (a mode is the only way to reach literals inside Megatron's function
    bodies without editing them).
 3. CUDA streams/events/synchronize become no-ops (CPU work is already ordered).
 4. `moe_utils.te_general_gemm` is defined as None when TE is absent (0.16.1 NameError).
 5. See 2.
 6. `Tensor.type()` (no argument) reports the CUDA type name, so the optimizer's and grad
    clipping's dtype asserts accept CPU parameters.
 7. `WrappedTorchNorm` accepts sequence parallelism (MoE + TP requires it) and tags its params
    `.sequence_parallel = True` so their gradients are all-reduced across TP, as TE's norm does.
 8. The alltoall dispatcher's split sizes become numpy arrays (only CUDA tensors were converted).
 9. Uneven all-gather / reduce-scatter (expert TP > 1) are rebuilt from even gloo collectives.
10. RoPE on packed (`thd`) rows gathers each token's frequencies by its position in its sample in
    one indexing op, instead of Megatron's per-sample slice-and-concatenate loop (a Python step per
    sample, per layer, for q and k: the local layer spec is the only user of that path).
11. Functions Megatron compiles (`jit_fuser` is `torch.compile` from torch 2.2: the router's
    expert-bias count, the experts' GLU) run eagerly. On CPU, inductor builds each one with the
    machine's C++ compiler at run time, once per new shape: 5-9 s per run of the tiny DeepSeek-V3
    on 2 cores (36.1 s -> 25.9 s, cold cache), a compiler every user would need, for element-wise
    kernels that gain nothing here.

Everything here is process-wide by necessity (Megatron's own calls are), idempotent, and never
runs when the device is CUDA: `activate()` refuses to run if CUDA is available and in use.

Where the mode of item 2 is active: everywhere, except inside `suspended()`. It costs a Python
call per torch operation, which was about a sixth of a tiny CPU RL step, while a step needs it
only in Megatron's schedule and optimizer (their `device="cuda"` literals and `.type()` asserts).
So the hot code that never names a CUDA device runs suspended: the model's forward and our loss
(model/policy.py) and the in-process vLLM engine (rollout/engines/vllm_colocated.py). Measured over a
step: no call inside them needed the mode (Megatron-Core's forward allocates with
`torch.cuda.current_device()`, item 2's patched "cpu", or with its inputs' device); its CUDA
literals sit in the schedule, the optimizer, checkpointing and `track_moe_metrics`, which runs in
Megatron's own training loop, not ours. A forward that did reach one would fail loudly ("Torch not
compiled with CUDA enabled"), never compute wrongly.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack, _pop_mode_temporarily

_lock = threading.Lock()
_active_mode: TorchFunctionMode | None = None  # the one mode instance, entered for the process


def is_active() -> bool:
    return _active_mode is not None


@contextlib.contextmanager
def suspended():
    """Run the body without the CUDA-to-CPU mode (see the module docstring for where).

    A no-op when the layer is not active, or when another mode sits above ours on the stack (then
    the body simply keeps the redirection: slower, never wrong)."""
    stack = _get_current_function_mode_stack() if _active_mode is not None else []
    if not stack or stack[-1] is not _active_mode:
        yield
        return
    with _pop_mode_temporarily():
        yield


def activate() -> None:
    """Install every redirection. Call before building any Megatron-Core object."""
    global _active_mode
    with _lock:
        if _active_mode is not None:
            return
        if torch.cuda.is_available():
            raise RuntimeError(
                "device: cpu was chosen on a machine with CUDA; the CPU compatibility layer would "
                "redirect Megatron-Core's CUDA calls process-wide. Use device: auto (or cuda) here; "
                "device: cpu is for machines without a GPU."
            )
        _patch_torch_cuda()
        _patch_megatron()
        _run_compiled_functions_eagerly()
        mode = _CudaToCpuMode()
        mode.__enter__()  # stays entered for the life of the process: Megatron is CPU-bound now
        _active_mode = mode


def _run_compiled_functions_eagerly() -> None:
    """11: torch.compile'd functions run as plain Python (read at each call, so it also holds for
    the functions Megatron decorated when it was imported)."""
    from torch._dynamo import config as dynamo_config

    dynamo_config.disable = True


# ----------------------------------------------------------------------------------------------
# 2, 5, 6: CUDA device arguments, .cuda(), .type()
# ----------------------------------------------------------------------------------------------


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # An int device means "cuda:<int>" to torch; Megatron passes torch.cuda.current_device().
    return isinstance(device, int) and not isinstance(device, bool)


_CPU = torch.device("cpu")
_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


class _CudaToCpuMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _TYPE_NAMES.get(name, name)
        if func is torch.Tensor.to:
            args = tuple(_CPU if _is_cuda_device(a) else a for a in args)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device=_CPU)
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------------------------
# 1, 3: RNG in the CPU generator; streams/events as no-ops
# ----------------------------------------------------------------------------------------------


class _NoOpStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NoOpEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _NoOpEvent(_NoOpStream):
    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def elapsed_time(self, *args, **kwargs):
        return 0.0


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    # "cpu", not an int: torch reads an int device as cuda:<int>, and this value is also used
    # inside autograd backward functions, where the function mode below is not active (a mode
    # is switched off while its own handler runs, e.g. around torch.autograd.backward). The only
    # call sites needing an int are NCCL-only and CUDA-graph paths that never run on CPU.
    cuda.current_device = lambda: "cpu"
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    # Seed the CPU generator directly: torch.manual_seed itself calls torch.cuda.manual_seed_all,
    # which stays the original (a no-op without CUDA).
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.Stream = _NoOpStream
    cuda.Event = _NoOpEvent
    cuda.current_stream = lambda *a, **k: _NoOpStream()
    cuda.default_stream = lambda *a, **k: _NoOpStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None


def _patch_megatron() -> None:
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel import mappings, random
    from megatron.core.transformer import torch_norm
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    # 1: the tracker keeps named CPU generator states.
    random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    # 4
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    # 7
    torch_norm.WrappedTorchNorm.__new__ = _wrapped_torch_norm_new(torch_norm.WrappedTorchNorm.__new__)

    # 8: token_dispatcher imported the function by name, so patch it there.
    token_dispatcher.maybe_move_tensor_to_cpu = _maybe_move_tensor_to_cpu

    # 10: apply_rotary_pos_emb looks the thd helper up as a module global at call time.
    rope_utils._apply_rotary_pos_emb_thd = _rope_thd_gathered(rope_utils._apply_rotary_pos_emb_thd,
                                                              rope_utils._apply_rotary_pos_emb_bshd)

    # 9: mappings' autograd functions look these up as module globals at call time.
    mappings._gather_along_first_dim = _gather_along_first_dim(mappings._gather_along_first_dim)
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_along_first_dim(
        mappings._reduce_scatter_along_first_dim
    )


def _wrapped_torch_norm_new(original_new):
    @functools.wraps(original_new)
    def new(cls, config, hidden_size, *args, **kwargs):
        # The upstream assert only reflects that torch's norm has no SP-aware grad reduction;
        # tagging the params makes finalize_model_grads all-reduce them across TP, which is
        # exactly what the TE norm does on GPU.
        sequence_parallel = config.sequence_parallel
        config.sequence_parallel = False
        try:
            norm = original_new(cls, config, hidden_size, *args, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        if sequence_parallel:
            for param in norm.parameters():
                param.sequence_parallel = True
        return norm

    return new


def _rope_thd_gathered(original, apply_bshd):
    @functools.wraps(original)
    def apply_thd(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0,
                  cp_group=None):
        if cp_group is None or cp_group.size() > 1:
            return original(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                            multi_latent_attention=multi_latent_attention, mscale=mscale, cp_group=cp_group)
        total = t.shape[0]
        if freqs.size(0) == int(cu_seqlens[-1]):
            packed = freqs  # Megatron's "exact mapping" case: one frequency row per packed token
        else:
            # Position of every token within its own sample: what the per-sample slices index.
            starts = cu_seqlens[:-1].to(torch.long)
            lengths = cu_seqlens[1:].to(torch.long) - starts
            positions = torch.arange(total, device=t.device) - torch.repeat_interleave(starts, lengths, output_size=total)
            packed = freqs.index_select(0, positions)
        return apply_bshd(t.unsqueeze(1), packed, rotary_interleaved=rotary_interleaved,
                          multi_latent_attention=multi_latent_attention, mscale=mscale).squeeze(1)

    return apply_thd


def _maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _gather_along_first_dim(original):
    @functools.wraps(original)
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        # gloo has no uneven all_gather: pad every rank's rows to the largest, gather evenly,
        # then drop the padding.
        sizes = [int(s) for s in output_split_sizes]
        largest = max(sizes)
        padded = input_.new_zeros((largest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        gathered = torch.empty(
            (largest * group.size(), *input_.shape[1:]), dtype=input_.dtype, device=input_.device
        )
        dist.all_gather_into_tensor(gathered, padded.contiguous(), group=group)
        pieces = [gathered[r * largest : r * largest + n] for r, n in enumerate(sizes)]
        return torch.cat(pieces, dim=0)

    return gather


def _reduce_scatter_along_first_dim(original):
    @functools.wraps(original)
    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        # gloo has no list reduce_scatter: all-reduce the whole tensor and keep our rows. This
        # moves world_size times more bytes than a true reduce-scatter; fine for CPU tests.
        sizes = [int(s) for s in input_split_sizes]
        start = sum(sizes[: group.rank()])
        reduced = input_.contiguous().clone()
        dist.all_reduce(reduced, group=group)
        return reduced[start : start + sizes[group.rank()]].contiguous()

    return reduce_scatter
