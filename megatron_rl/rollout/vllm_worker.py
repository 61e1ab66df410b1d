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

A reload must see complete layers in a single call (vLLM processes a layer once all its
parameters arrived, and layers left incomplete are finalized from uninitialized memory), so each
method below takes the whole model and reloads it in one call; the tensors are read lazily, so
memory stays at about one tensor beyond the model.
"""

from __future__ import annotations

import json
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


def _repack_cpu_moe(model: torch.nn.Module) -> int:
    """Redo the CPU MoE kernel's weight packing after an in-place reload (see module docstring)."""
    try:
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.utils import replace_parameter
    except ImportError:  # not a CPU build: GPU MoE kernels take updated weights as they are
        return 0
    repacked = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        intermediate = experts.moe_config.intermediate_size_per_partition
        if experts._padded_intermediate_size(experts.moe_config) != intermediate:
            # The first load zero-pads the intermediate dimension for this kernel; re-deriving that
            # layout from reloaded weights is not implemented, so refuse instead of serving garbage.
            raise RuntimeError(
                f"CPU MoE weight update is not supported when vLLM pads the expert intermediate size "
                f"({intermediate}); use an intermediate size the CPU kernel accepts unpadded"
            )
        replace_parameter(module, "w13_weight", cpu_prepack_moe_weight(module.w13_weight, experts.isa))
        replace_parameter(module, "w2_weight", cpu_prepack_moe_weight(module.w2_weight, experts.isa))
        repacked += 1
    return repacked
