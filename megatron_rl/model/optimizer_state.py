"""Optimizer state keyed like the model's weights, so that it reshards exactly as they do.

Megatron-Core 0.16.1 cannot resume its own optimizer checkpoints at another layout on this stack
(measured on CPU): EP2 -> 1 process fails with both `dp_reshardable` and `fully_reshardable`
(at EP > 1 the optimizer is a ChainedOptimizer whose keys carry `chained_N.` prefixes, at EP1 a
plain one), `fully_reshardable` fails even a same-layout round trip (KeyError 'step'), and
`fully_sharded_model_space` cannot save ("flattened_range is not supported").

So we store each per-parameter optimizer tensor (Adam's two moments, and the fp32 main weights
when the model is bf16) as a sharded tensor with the SAME sharding metadata as the model weight
it belongs to, under a prefixed key:

    decoder.layers.mlp.experts.weight1            (the weight; global shape, offsets, replica)
    optimizer.exp_avg.decoder.layers.mlp.experts.weight1
    optimizer.exp_avg_sq.decoder.layers.mlp.experts.weight1
    optimizer.main_param.decoder.layers.mlp.experts.weight1   (bf16 models only)

torch_dist reshards such tensors across TP, PP, EP and DP like the weights themselves, and the
keys do not depend on how the optimizer is chained. The distributed optimizer holds only a
flat slice of each parameter per DP rank: saving sums the slices over its DP group into whole
parameters (the slices are disjoint), loading cuts this rank's slice back out.

Adam's step count and the LR schedule are plain numbers the caller stores itself.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from megatron_rl.model.state import model_state

MOMENTS = ("exp_avg", "exp_avg_sq")


def param_entries(module: torch.nn.Module, model_sharded: dict) -> dict[str, object]:
    """{parameter name: the model sharded-state-dict entry (ShardedTensor or factory) holding it},
    for every parameter and state buffer (model/state.py: the KL reference keeps those too)."""
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    by_id = {}
    sharded, _ = extract_sharded_tensors_and_factories(model_sharded)
    for entry in nested_values(sharded):
        by_id[id(entry.data)] = entry
    entries = {}
    for name, param in model_state(module):
        if id(param) not in by_id:
            raise RuntimeError(f"parameter {name} has no entry in the model's sharded state dict; "
                               "its optimizer state could not be checkpointed")
        entries[name] = by_id[id(param)]
    return entries


def keyed_like(entry, data: torch.Tensor, prefix: str):
    """A sharded tensor (or factory) for `data`, sharded exactly as the model entry `entry`."""
    return replace(entry, key=f"{prefix}.{entry.key}", data=data, **({} if _is_factory(entry) else {"dtype": data.dtype}))


def _is_factory(entry) -> bool:
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    return isinstance(entry, ShardedTensorFactory)


class OptimizerStateView:
    """Whole-parameter optimizer tensors of a Megatron optimizer (plain, mixed-precision,
    distributed, or a chain of them), read and written per model parameter."""

    def __init__(self, optimizer, module: torch.nn.Module, with_main_params: bool):
        self.optimizer = optimizer
        self.module = module
        self.names = [name for name, _ in module.named_parameters()]
        self.params = dict(module.named_parameters())
        self.states = MOMENTS + (("main_param",) if with_main_params else ())
        self._owned: dict[int, set[int]] = {}  # id(optimizer part) -> ids of the parameters it updates

    # ---- read ----------------------------------------------------------------------------------

    def gather(self) -> dict[str, dict[str, torch.Tensor]]:
        """{state name: {param name: whole-parameter fp32 tensor}} (collective over each
        distributed optimizer's DP group). Where this rank holds whole parameters the tensors
        are views of the optimizer's own state, not copies: write them out before the next
        optimizer step (a forked writer's copy-on-write snapshot counts as written)."""
        self.ensure_state()  # a checkpoint before the first update saves zero moments
        out = {state: {} for state in self.states}
        for part in _parts(self.optimizer):
            names = [n for n in self.names if self._owned_by(part, self.params[n])]
            if _is_distributed(part) and part.data_parallel_group.size() > 1:
                self._gather_distributed(part, names, out)
                continue
            for name in names:
                param = self.params[name]
                for key, tensor in self._local(part, param).items():
                    out[key][name] = tensor.detach().view(param.shape)
        return out

    def _local(self, part, param) -> dict[str, torch.Tensor]:
        """{state: tensor} of a parameter this rank holds whole (no DP sharding)."""
        if _is_distributed(part):
            tensors = part._get_main_param_and_optimizer_states(param)
            return {key: tensors["param" if key == "main_param" else key] for key in self.states}
        main, state = _plain_slot(part, param)
        return {key: main if key == "main_param" else state[key] for key in self.states}

    def _gather_distributed(self, part, names: list[str], out: dict) -> None:
        params = [self.params[n] for n in names]
        sizes = [p.numel() for p in params]
        flat = torch.zeros(len(self.states), sum(sizes), dtype=torch.float32, device=_device(params))
        offset = 0
        for param, size in zip(params, sizes):
            if param in part.model_param_gbuf_map:
                local = part._get_model_param_range_map(param)["param"]
                tensors = part._get_main_param_and_optimizer_states(param)
                for row, key in enumerate(self.states):
                    flat[row, offset + local.start: offset + local.end] = tensors["param" if key == "main_param" else key].detach().view(-1)
            offset += size
        # Each DP rank holds a disjoint slice of every parameter, zeros elsewhere: a sum is a gather.
        dist.all_reduce(flat, group=part.data_parallel_group)
        offset = 0
        for name, param, size in zip(names, params, sizes):
            for row, key in enumerate(self.states):
                out[key][name] = flat[row, offset: offset + size].view(param.shape)  # views of the fresh buffer
            offset += size

    # ---- write ---------------------------------------------------------------------------------

    def scatter(self, loaded: dict[str, dict[str, torch.Tensor]]) -> None:
        """Write whole-parameter tensors (as gather() returns them) into the optimizer."""
        self.ensure_state()
        with torch.no_grad():
            for part in _parts(self.optimizer):
                for name in self.names:
                    param = self.params[name]
                    if not self._owned_by(part, param):
                        continue
                    if _is_distributed(part):
                        if param not in part.model_param_gbuf_map:
                            continue
                        local = part._get_model_param_range_map(param)["param"]
                        tensors = part._get_main_param_and_optimizer_states(param)
                        for key in self.states:
                            target = tensors["param" if key == "main_param" else key]
                            target.copy_(loaded[key][name].reshape(-1)[local.start: local.end].view_as(target))
                    else:
                        main, state = _plain_slot(part, param)
                        for key in self.states:
                            target = main if key == "main_param" else state[key]
                            target.copy_(loaded[key][name].view_as(target))

    def ensure_state(self) -> None:
        """Give a freshly built optimizer (which has no Adam state until its first step) zero
        moments, so there is somewhere to load into."""
        for part in _parts(self.optimizer):
            inner = part.optimizer
            for group in inner.param_groups:
                for param in group["params"]:
                    if param not in inner.state or "exp_avg" not in inner.state[param]:
                        inner.state[param] = {"step": torch.tensor(0.0),
                                              "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                                              "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}

    def _owned_by(self, part, param) -> bool:
        if id(part) not in self._owned:
            if _is_distributed(part):
                owned = {id(p) for buffer in part.buffers for p in buffer.params}
            else:
                owned = {id(p) for group in _model_groups(part) for p in group}
            self._owned[id(part)] = owned
        return id(param) in self._owned[id(part)]


def _parts(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(part) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(part, DistributedOptimizer)


def _model_groups(part):
    """The model parameters an undistributed optimizer updates, per group."""
    if hasattr(part, "float16_groups"):  # mixed precision: fp32 main copies of bf16 weights
        return [*part.float16_groups, *part.fp32_from_fp32_groups]
    return [group["params"] for group in part.optimizer.param_groups]


def _plain_slot(part, param):
    """(main parameter, Adam state dict) of a model parameter in an undistributed optimizer."""
    if hasattr(part, "float16_groups"):
        for model_group, main_group in zip(part.float16_groups, part.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                if model_param is param:
                    return main_param, part.optimizer.state[main_param]
    return param, part.optimizer.state[param]


def _device(params) -> torch.device:
    return params[0].device if params else torch.device("cpu")
