"""Code that runs inside vLLM's workers: weight loading that is correct on every backend.

vLLM injects this class into its worker (`LLM(..., worker_extension_cls=WORKER_EXTENSION)` or
`--worker-extension-cls` for the server) and exposes its methods through `collective_rpc`
(the documented extension point); `self.model_runner` is the worker's model runner.

Why not `model.load_weights` directly: on vLLM's CPU backend it fails half-way after the first
load (parameters lose their `weight_loader`), leaving a corrupted model. The in-place reload
(`model_runner.reload_weights`) works, with one silent exception we repair here: CPU MoE expert
weights are repacked for the CPU MoE kernel only on the first load, so after a reload the kernel
reads unpacked weights and every MoE output is wrong (no error is raised). `_repack_cpu_moe`
redoes the packing, and the rollout tests compare the engine's logprobs with the trainer's after
every push, which is the only way to catch this class of bug.

Measured with DeepSeek-V3 (multi-latent attention) and GLM-4.5 and found to need no repair: MLA's
weights derived from kv_b_proj (W_UK_T, W_UV, used by decode) are views of kv_b_proj's weight on
the CPU build, and the reload re-runs MLA's post-load processing anyway; the routers'
`e_score_correction_bias` is a vLLM parameter the reload updates; shared experts are a plain MLP
beside the repacked routed experts (tests/rollout/test_vllm_families.py pushes new values for all).

One repair is not about reloading: `fix_cpu_rotary_embedding` (applied when this module is imported
into a process that already runs vLLM, i.e. the server's workers, and by the colocated engine
before it builds its model) makes vLLM's CPU rotary kernel correct for the 3-D query/key that
multi-latent attention passes it.

A reload must see complete layers in a single call (vLLM processes a layer once all its
parameters arrived, and layers left incomplete are finalized from uninitialized memory), so each
method below takes the whole model and reloads it in one call; the tensors are read lazily, so
memory stays at about one tensor beyond the model.
"""

from __future__ import annotations

import json
import sys
from typing import Iterable, Iterator

import torch

WORKER_EXTENSION = "megatron_rl.rollout.vllm_worker.WeightSyncWorker"


class WeightSyncWorker:
    model_runner = None  # provided by the vLLM worker this class is mixed into

    # ---- CPU / same-process transports -------------------------------------------------------

    def update_weights_from_stream(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Same-process push (the colocated engine): tensors are passed by reference."""
        return self._reload(iter(weights))

    def update_weights_from_files(self, paths_json: str) -> int:
        """Push through safetensors files on a filesystem the trainer and the server share.

        The argument is a JSON list of paths (vLLM's HTTP `collective_rpc` passes strings only)."""
        paths = json.loads(paths_json)
        return self._reload(_read_safetensors(paths))

    def weights_fingerprint(self) -> dict:
        """Sum and element count of every parameter: cheap evidence that a push changed the model."""
        total, count = 0.0, 0
        for _, param in self.model_runner.get_model().named_parameters():
            total += float(param.detach().double().sum())
            count += param.numel()
        return {"sum": total, "numel": count}

    # ---- GPU transport (NCCL broadcast from the trainer) --------------------------------------
    # Written to vLLM's documented weight-update pattern: the trainer's rank 0 and every engine
    # worker join one NCCL group over a TCP rendezvous; the trainer broadcasts each tensor and the
    # workers feed them to the same in-place reload. Exercised only on a machine with CUDA GPUs;
    # the CPU test suite cannot run it.

    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int) -> None:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.parallel_state import get_world_group
        from vllm.distributed.utils import StatelessProcessGroup

        rank = get_world_group().rank + int(rank_offset)
        group = StatelessProcessGroup.create(host=master_address, port=int(master_port), rank=rank,
                                             world_size=int(world_size))
        self._weight_group = PyNcclCommunicator(group, device=self.device)

    def update_weights_from_broadcast(self, metadata_json: str) -> int:
        """metadata_json: JSON list of [name, dtype, shape] in the order the trainer broadcasts."""
        group = getattr(self, "_weight_group", None)
        if group is None:
            raise RuntimeError("init_weight_update_group must be called before update_weights_from_broadcast")
        metadata = json.loads(metadata_json)

        def received() -> Iterator[tuple[str, torch.Tensor]]:
            for name, dtype, shape in metadata:
                tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
                group.broadcast(tensor, src=0, stream=torch.cuda.current_stream())
                yield name, tensor

        count = self._reload(received())
        torch.cuda.synchronize()
        return count

    # ---- internals ----------------------------------------------------------------------------

    def _reload(self, weights: Iterator[tuple[str, torch.Tensor]]) -> int:
        model = self.model_runner.get_model()
        _cpu_moe_kernels(model)  # refuses a layout it cannot repack before anything is overwritten
        tied = _tied_parameters(model)
        counted = _Counted(weights)
        self.model_runner.reload_weights(weights_iterator=counted, is_checkpoint_format=True)
        _retie(model, tied)
        _repack_cpu_moe(model)
        return counted.count


class _Counted:
    def __init__(self, items: Iterator[tuple[str, torch.Tensor]]):
        self.items, self.count = items, 0

    def __iter__(self):
        for item in self.items:
            self.count += 1
            yield item


def _read_safetensors(paths: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in paths:
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def _tied_parameters(model: torch.nn.Module) -> list[list[str]]:
    """Groups of parameter names that share storage (tied input/output embeddings)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(param.data_ptr(), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _retie(model: torch.nn.Module, tied: list[list[str]]) -> None:
    """Bring tied weights back in line after a reload.

    Measured on vLLM's CPU build with a tied-embedding Qwen3: the checkpoint carries only
    `embed_tokens`; the reload finds nothing for `lm_head` and skips its post-load processing,
    so the output layer's packed GEMM copy (made from the weight at load time) keeps the previous
    weights and logprobs are off by ~0.2 with no error. The first name of each group is the one
    the checkpoint loads (HF tied models store the input embedding): its values go to the others,
    and their modules redo their post-load processing."""
    parameters = dict(model.named_parameters(remove_duplicate=False))
    for names in tied:
        source = parameters[names[0]]
        for name in names[1:]:
            target = parameters[name]
            if target.data_ptr() != source.data_ptr():
                target.data.copy_(source.data)
            module = model.get_submodule(name.rpartition(".")[0])
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)


def _cpu_moe_kernels(model: torch.nn.Module) -> list[tuple[torch.nn.Module, object]]:
    """The (layer, CPU MoE experts kernel) pairs of a CPU build's model; empty on other builds.

    Refuses a model whose expert intermediate size the first load zero-padded for the kernel
    (to the kernel's alignment, 32 on the machines measured: moe_intermediate_size 32 at vLLM
    TP 2 was padded from 16 per rank). Re-deriving that layout from reloaded weights is not
    implemented, and vLLM's own reload then fails half-way on a shape mismatch (measured), with
    layers already overwritten; so this runs before the reload, and names the fix."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # not a CPU build: GPU MoE kernels take updated weights as they are
        return []
    found = []
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        intermediate = experts.moe_config.intermediate_size_per_partition
        padded = experts._padded_intermediate_size(experts.moe_config)
        if padded != intermediate:
            raise RuntimeError(
                f"CPU MoE weight update is not supported when vLLM pads the expert intermediate size "
                f"({intermediate} per tensor-parallel rank, padded to {padded}); use a "
                f"moe_intermediate_size that is a multiple of {experts._intermediate_alignment()} per rank"
            )
        found.append((module, experts))
    return found


def _repack_cpu_moe(model: torch.nn.Module) -> int:
    """Redo the CPU MoE kernel's weight packing after an in-place reload (see module docstring)."""
    kernels = _cpu_moe_kernels(model)
    if not kernels:
        return 0
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.utils import replace_parameter

    for module, experts in kernels:
        replace_parameter(module, "w13_weight", cpu_prepack_moe_weight(module.w13_weight, experts.isa))
        replace_parameter(module, "w2_weight", cpu_prepack_moe_weight(module.w2_weight, experts.isa))
    return len(kernels)


def fix_cpu_rotary_embedding() -> bool:
    """Make vLLM's CPU rotary-embedding kernel correct for 3-D `[tokens, heads, head_size]` inputs.

    Measured on vLLM's CPU build (0.32): `torch.ops._C.rotary_embedding` is right for 2-D
    `[tokens, heads * head_size]` query/key (strided row views included) but not for 3-D ones: a
    contiguous `[7, 3, 64]` query came back off by up to 4.5 in every head, and a `[7, 1, 64]`
    key viewed out of a wider row (stride 576) was left unrotated while the kernel wrote into
    the neighbouring columns. vLLM's multi-latent attention (DeepSeek-V2/V3, Kimi-K2) hands
    exactly such views to `RotaryEmbedding` (q's rotary half per head, k_pe out of the
    kv_a_proj output). With plain RoPE a tiny DeepseekV3ForCausalLM served logprobs off by
    0.1-0.3 from transformers' from the very first load (position 0 exact, every later one
    wrong), with no error; after this fix they agree to ~1e-6. (YaRN RoPE, which the published
    DeepSeek checkpoints use, is a different class that computes RoPE in PyTorch on CPU.)

    The fix wraps `RotaryEmbedding.forward_cpu` at class level: 3-D inputs are flattened into
    2-D copies, rotated by the same kernel, and written back in place, so callers that rely on
    the in-place update and callers that use the returned tensors both see the right values.
    Must run before the model is built (vLLM binds the forward method at construction).
    Idempotent; returns False where there is nothing to fix (not a vLLM build with this class)."""
    try:
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    except ImportError:
        return False
    original = RotaryEmbedding.forward_cpu
    if getattr(original, "_flattens_3d_inputs", False):
        return True

    def forward_cpu(self, positions, query, key=None):
        if query.dim() <= 2 and (key is None or key.dim() <= 2):
            return original(self, positions, query, key)
        tokens = positions.numel()
        flat_query = query.reshape(tokens, -1).clone()
        flat_key = None if key is None else key.reshape(tokens, -1).clone()
        rotated_query, rotated_key = original(self, positions, flat_query, flat_key)
        query.copy_(rotated_query.view_as(query))
        if key is not None:
            key.copy_(rotated_key.view_as(key))
        return query, key

    forward_cpu._flattens_3d_inputs = True
    forward_cpu.__doc__ = original.__doc__
    RotaryEmbedding.forward_cpu = forward_cpu
    return True


if "vllm" in sys.modules:
    # vLLM imports this module into each worker to inject the extension, before it builds the
    # model: the place to fix what must be fixed before then (see fix_cpu_rotary_embedding).
    fix_cpu_rotary_embedding()
