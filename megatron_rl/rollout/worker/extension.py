"""Code that runs inside vLLM's workers: weight loading that is correct on every backend.

vLLM injects this class into its worker (`LLM(..., worker_extension_cls=WORKER_EXTENSION)` or
`--worker-extension-cls` for the server) and exposes its methods through `collective_rpc`
(the documented extension point); `self.model_runner` is the worker's model runner.

Why not `model.load_weights` directly: on vLLM's CPU backend it fails half-way after the first
load (parameters lose their `weight_loader`), leaving a corrupted model. The in-place reload
(`model_runner.reload_weights`) works, with one silent exception we repair here: CPU MoE expert
weights are repacked for the CPU MoE kernel only on the first load, so after a reload the kernel
reads unpacked weights and every MoE output is wrong (no error is raised). `repack_cpu_moe`
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

In-place updates (vLLM's CPU build): vLLM's reload rebuilds every layer from fresh memory and
copies the result back, and after it every CPU MoE layer is packed again (measured: about 9-14
memory copies of the pushed bytes in all). So only the first push takes that path; it also traces
where each pushed tensor lands (`InPlacePlan`), and every later push copies straight into the
engine's parameters and redoes only the packing that the CPU kernels derive from them (linear
layers' and the output layer's GEMM weights; MoE experts are written directly in their packed
layout). Every transport ends in `_reload`, which picks the path and records where the time went
(`weight_update_profile`). Models or layers the plan does not know keep the full reload, with a
warning.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Iterable, Iterator

import torch

from megatron_rl.rollout.weights.digest import WeightDigest, digesting, served_sum
from megatron_rl.rollout.worker.inplace_copy import InPlacePlan, in_place_supported
from megatron_rl.rollout.worker.lora_adapters import LoraAdapterWorker
from megatron_rl.rollout.worker.prompt_logprobs import batch_prompt_logprobs
from megatron_rl.rollout.worker.route_capture import RouteCaptureWorker
from megatron_rl.runtime.cpu.vllm_repairs import (cpu_moe_kernels, fix_cpu_rotary_embedding,
                                                  fix_cpu_seeded_chunked_prefill, repack_cpu_moe)
from megatron_rl.rollout.worker.receiver import CollectiveReceiverWorker

WORKER_EXTENSION = "megatron_rl.rollout.worker.extension.WeightSyncWorker"

logger = logging.getLogger(__name__)


class WeightSyncWorker(CollectiveReceiverWorker, RouteCaptureWorker, LoraAdapterWorker):
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

    def sampler_logprobs_mode(self) -> str:
        """What this worker returns as a sampled token's logprob (vLLM's logprobs_mode): the
        trainer needs the sampling distribution's, after temperature (rollout/engines/vllm_common.py)."""
        return str(self.model_runner.model_config.logprobs_mode)

    def weights_fingerprint(self) -> dict:
        """What the last push delivered and whether the served weights moved since
        (rollout/weights/digest.py): `received` (a WeightDigest of the pushed tensors, None before
        the first push), `served_at_push` and `served_now` (float64 sums of the parameters)."""
        return {"received": getattr(self, "last_received", None),
                "served_at_push": getattr(self, "served_at_push", None),
                "served_now": served_sum(self.model_runner.get_model().parameters())}

    def weight_update_profile(self) -> dict:
        """The last push's path and where its time went (see `_reload`), and the plan's state."""
        return dict(getattr(self, "last_weight_update", None) or {},
                    in_place_planned=getattr(self, "_weight_plan", None) is not None,
                    in_place_refused=getattr(self, "_weight_plan_refused", None))

    def set_in_place_weight_updates(self, enabled: bool) -> bool:
        """Off: every push runs vLLM's full reload (what pushes did before in-place copies; kept
        for comparison and as an escape hatch). On: the next push plans, the ones after copy."""
        self.in_place_weight_updates = bool(enabled)
        self._weight_plan = None  # off: dropped; on: planned afresh after the next push
        self._weight_plan_refused = None
        return self.in_place_weight_updates

    # The collective transport (gloo on CPU, NCCL on GPU) is CollectiveReceiverWorker's
    # (rollout/worker/receiver.py); it ends in the same `_reload`.

    # ---- internals ----------------------------------------------------------------------------

    # Pushes after the first one copy into the engine's parameters in place where this module
    # knows every parameter's kernel layout (`InPlacePlan`); False: vLLM's full reload every time
    # (benchmarks/rollout.py measures both).
    in_place_weight_updates = True

    def _reload(self, weights: Iterator[tuple[str, torch.Tensor]]) -> int:
        """The one way weights enter the engine, whatever the transport: the whole model, one pass.

        Returns the number of tensors consumed. `self.last_weight_update` says which path ran and
        where its time went (seconds; `stream_s` is time spent waiting on `weights`, i.e. the
        producer: bridge export, file reads or receives)."""
        model = self.model_runner.get_model()
        cpu_moe_kernels(model)  # refuses a layout it cannot repack before anything is overwritten
        received = WeightDigest()
        weights = digesting(weights, received)
        self.last_received = self.served_at_push = None  # a push that fails half-way matches nothing
        plan = getattr(self, "_weight_plan", None)
        if plan is not None and not (self.in_place_weight_updates and plan.current(model)):
            plan = self._weight_plan = None  # checked before anything is read: a clean fallback
        if plan is None:
            count, profile = self._full_reload(model, weights)
        else:
            try:
                count, profile = plan.apply(weights)
            except BaseException:
                self._weight_plan = None  # the next push reloads in full (and plans again)
                raise
            for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
                # what model_runner.reload_weights does after a reload
                if callable(getattr(self.model_runner, reset, None)):
                    getattr(self.model_runner, reset)()
        self.last_weight_update = profile
        self.last_received = received.to_dict()
        self.served_at_push = served_sum(model.parameters())
        logger.debug("vLLM weight update: %s", profile)
        return count

    def _full_reload(self, model: torch.nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> tuple[int, dict]:
        """vLLM's layer-wise reload plus this module's repairs; plans in-place updates afterwards."""
        started = time.perf_counter()
        tied = _tied_parameters(model)
        plan_next = (self.in_place_weight_updates and in_place_supported()
                     and not getattr(self, "_weight_plan_refused", None))
        counted = _Counted(weights, record=plan_next)
        self.model_runner.reload_weights(weights_iterator=counted, is_checkpoint_format=True)
        reloaded = time.perf_counter()
        _retie(model, tied)
        repack_cpu_moe(model)
        finished = time.perf_counter()
        profile = {"path": "full_reload", "tensors": counted.count, "total_s": finished - started,
                   "stream_s": counted.wait_s, "reload_s": reloaded - started - counted.wait_s,
                   "repair_s": finished - reloaded}
        if plan_next and counted.count:
            try:
                self._weight_plan = InPlacePlan.trace(model, counted.names)
            except Exception as refusal:  # noqa: BLE001 - any failure means: keep reloading in full
                self._weight_plan_refused = f"{type(refusal).__name__}: {refusal}"
                logger.warning("vLLM weight updates: in-place copies refused for this model, every push "
                               "will run vLLM's full reload (%s)", self._weight_plan_refused)
            profile["plan_s"] = time.perf_counter() - finished
        return counted.count, profile


class _Counted:
    """Counts what the reload consumes, the time spent waiting for it and, when asked, its names."""

    def __init__(self, items: Iterator[tuple[str, torch.Tensor]], record: bool = False):
        self.items, self.count, self.wait_s = iter(items), 0, 0.0
        self.names: list[tuple[str, tuple[int, ...], torch.dtype]] | None = [] if record else None

    def __iter__(self):
        while True:
            started = time.perf_counter()
            try:
                name, tensor = next(self.items)
            except StopIteration:
                self.wait_s += time.perf_counter() - started
                return
            self.wait_s += time.perf_counter() - started
            self.count += 1
            if self.names is not None:
                self.names.append((name, tuple(tensor.shape), tensor.dtype))
            yield name, tensor


# safetensors dtype names (the format's spec) -> torch dtypes this reader maps without a copy.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
    **{name: getattr(torch, attr) for name, attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"))
       if hasattr(torch, attr)},
}


def _read_safetensors(paths: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the files, in file order, as views of a private read-only mapping of each file.

    No copy is made here: the consumer's copy into the engine reads straight from the page cache
    (the trainer has just written these files). `safe_open(...).get_tensor` would first copy each
    tensor into a new one. The format is an 8-byte little-endian header length, a JSON header
    (name -> dtype, shape, [begin, end) byte offsets into the data that follows) and the data.
    Files with a dtype not mapped above, or on a big-endian host, are read by safetensors."""
    import mmap
    import struct

    for path in paths:
        with open(path, "rb") as handle:
            header_len = struct.unpack("<Q", handle.read(8))[0]
            header = json.loads(handle.read(header_len))
            header.pop("__metadata__", None)
            entries = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
            if sys.byteorder != "little" or any(entry["dtype"] not in _SAFETENSORS_DTYPES for _, entry in entries):
                yield from _read_with_safetensors(path)
                continue
            size = handle.seek(0, 2)
            # MAP_PRIVATE + PROT_WRITE only so that torch.frombuffer accepts the buffer: nothing
            # writes to it, so no page is ever copied and the file is never changed.
            mapping = mmap.mmap(handle.fileno(), size, flags=mmap.MAP_PRIVATE,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE) if size else None
        start = 8 + header_len
        for name, entry in entries:
            dtype, shape = _SAFETENSORS_DTYPES[entry["dtype"]], entry["shape"]
            begin, end = entry["data_offsets"]
            if end == begin:
                tensor = torch.empty(shape, dtype=dtype)
            else:
                tensor = torch.frombuffer(mapping, dtype=dtype, count=(end - begin) // dtype.itemsize,
                                          offset=start + begin).view(shape)
            yield name, tensor
        # The mapping closes when the last tensor viewing it is gone (a consumer may keep some).
        del mapping


def _read_with_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

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






if "vllm" in sys.modules:
    # vLLM imports this module into each worker to inject the extension, before it builds the
    # model: the place to fix what must be fixed before then (see fix_cpu_rotary_embedding).
    fix_cpu_rotary_embedding()
    fix_cpu_seeded_chunked_prefill()
    batch_prompt_logprobs()  # a served teacher's scoring: one engine step's prompt logprobs at once
