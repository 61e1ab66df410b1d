"""Low-rank adapters (LoRA; Hu et al. 2021, arXiv:2106.09685) on Megatron-Core's parallel linears.

    y = W x + (alpha / rank) * B (A dropout(x)),   W frozen, A [rank, in], B [out, rank], B = 0 at start

The adapters are built into the layer spec (`apply_to_layer_spec`), so they exist from the
model's construction, on the meta device too, and sit beside the weight they adapt under the same
module: `...linear_qkv.weight` keeps its name and gains `...linear_qkv.lora_A` / `lora_B`.

Sharding follows the base weight:
  column-parallel (qkv, fc1): B is split on the outputs like W; A is whole on every rank. The
      rank-r activation A x is gathered over the sequence (sequence parallelism) instead of x.
  row-parallel (proj, fc2): A is split on the inputs like W; B is whole. The partial sum
      B (A_r x_r) is added to the base's partial output before the base's own reduction, so one
      reduce (all-reduce or reduce-scatter) carries both.
  experts: every local expert's fc1 / fc2 has its own A and B, living with the expert on its
      EP rank and split over expert-TP like the expert's weight; their gradients go to the
      expert-parallel gradient buffers as the expert weights' do (`allreduce` copied from W).
The adapter that is whole on every rank of a split layer gets a gradient that is a partial sum
on each rank (of its output shard, or of its sequence slice): `_SumGradOver` sums it over the
(expert-)TP group in the backward. The router adapter (target `router`) is whole everywhere
like the router weight and is summed over TP by Megatron's finalize step, as that weight is
(`sequence_parallel` attribute).

Everything that is not an adapter is frozen (`freeze_base`): Megatron's DDP then allocates no
gradient buffer for it and its optimizer holds no state for it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from megatron_rl.model.state import is_adapter


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    dropout: float
    init: str  # "kaiming" (PEFT's default) or "gaussian"

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class _SumGradOver(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over `group` (an adapter whole on every
    rank whose per-rank gradient covers only that rank's shard of the layer)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _summed_over(tensor: torch.Tensor, group) -> torch.Tensor:
    return tensor if group is None or group.size() == 1 else _SumGradOver.apply(tensor, group)


def _add_adapters(layer, lora: LoraSettings, in_features: int, out_features: int, split: str) -> None:
    """lora_A [rank, in_features] and lora_B [out_features, rank] (local sizes) on `layer`, with
    the tensor-parallel tags of the dimension each is split along (`split`: "B" for column, "A"
    for row-parallel) and the weight's expert-gradient routing."""
    weight = layer.weight
    layer.lora = lora
    layer.lora_A = torch.nn.Parameter(torch.zeros(lora.rank, in_features, dtype=weight.dtype, device=weight.device))
    layer.lora_B = torch.nn.Parameter(torch.zeros(out_features, lora.rank, dtype=weight.dtype, device=weight.device))
    split_param, split_dim = (layer.lora_B, 0) if split == "B" else (layer.lora_A, 1)
    if layer.tp_group.size() > 1:
        set_tensor_model_parallel_attributes(split_param, True, split_dim, 1)
    else:
        # Over a group of one neither is a copy: tagged like every Megatron weight at TP1. Megatron's
        # gradient norm counts an untagged parameter on rank 0 of the attention's TP group only, so
        # an expert's adapters at expert-TP 1 beside TP2 attention (distinct expert-DP shards on the
        # TP ranks) would otherwise be left out of the norm on TP rank 1.
        for param, dim in ((layer.lora_A, 1), (layer.lora_B, 0)):
            set_tensor_model_parallel_attributes(param, True, dim, 1)
    for param in (layer.lora_A, layer.lora_B):
        # Expert adapters' gradients are reduced over the expert-data-parallel group, as the
        # expert weights' are (Megatron's DDP reads this attribute).
        param.allreduce = getattr(weight, "allreduce", True)
    _tag_scale(layer)


def _tag_scale(layer) -> None:
    """The adapter's scale on A, where the export reads it (bridge/placement.py)."""
    layer.lora_A.lora_scale = layer.lora.scale


def _dropout(layer, x: torch.Tensor) -> torch.Tensor:
    return F.dropout(x, p=layer.lora.dropout, training=layer.training) if layer.lora.dropout else x


class LoraColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear + adapter: B split on the outputs, A whole."""

    def __init__(self, *args, lora: LoraSettings, gated: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        if self.gather_output:
            raise ValueError("LoRA is not built on a column-parallel linear that gathers its output")
        self.gated = gated  # a SwiGLU fc1: B's rows are [gate; up] per TP shard, as W's
        _add_adapters(self, lora, self.input_size, self.output_size_per_partition, split="B")

    def forward(self, input_, weight=None, runtime_gather_output=None):
        output, bias = super().forward(input_, weight, runtime_gather_output)
        return output + self.lora_delta(input_), bias

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        split = self.tp_group.size() > 1
        # A's gradient on a rank is a share to be summed over the group: with sequence parallelism
        # that of the rank's own rows of x (A x is then gathered over the sequence, not x); for an
        # expert that of the rank's output shard (the dispatcher gave every rank all the tokens and
        # sums the input gradients itself). Without either, x is whole on every rank and copy_to's
        # backward sums the gradient of A x instead.
        a = _summed_over(self.lora_A, self.tp_group) if split and (self.sequence_parallel or self.explicit_expert_comm) \
            else self.lora_A
        h = F.linear(_dropout(self, x), a)
        if split and not self.explicit_expert_comm:
            h = (gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=self.tp_group)
                 if self.sequence_parallel else copy_to_tensor_model_parallel_region(h, group=self.tp_group))
        return F.linear(h, self.lora_B) * self.lora.scale

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        sharded = make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 0, "bias": 0, "lora_B": 0},
                                                      sharded_offsets, tp_group=self.tp_group,
                                                      dp_cp_group=metadata["dp_cp_group"])
        if self.gated:  # like the weight (MLP.sharded_state_dict): each half split on its own
            key = f"{prefix}lora_B"
            sharded[key] = apply_swiglu_sharded_factory(sharded[key], sharded_offsets,
                                                        (metadata or {}).get("singleton_local_shards", False))
        return sharded


class LoraRowParallelLinear(RowParallelLinear):
    """RowParallelLinear + adapter: A split on the inputs, B whole; the adapter's partial output
    joins the base's partial output before the base's reduction."""

    def __init__(self, *args, lora: LoraSettings, **kwargs):
        super().__init__(*args, **kwargs)
        _add_adapters(self, lora, self.input_size_per_partition, self.output_size, split="A")

    def _forward_impl(self, input, weight, *args, **kwargs):
        output = super()._forward_impl(input, weight, *args, **kwargs)
        return output + self.lora_delta(input)

    def lora_delta(self, x_local: torch.Tensor) -> torch.Tensor:
        # Every rank's gradient of the partial output is the whole output's: B's gradient on a
        # rank covers that rank's input shard only, summed over the group in the backward.
        b = _summed_over(self.lora_B, self.tp_group)
        return F.linear(F.linear(_dropout(self, x_local), self.lora_A), b) * self.lora.scale

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 1, "lora_A": 1}, sharded_offsets,
                                                   tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])


def lora_router(router_class: type) -> type:
    """`router_class` with an adapter on its gating linear (in the router's fp32 dtype), whole on
    every rank like the router weight and reduced over TP as it is."""

    class LoraRouter(router_class):
        def __init__(self, *args, lora: LoraSettings, **kwargs):
            super().__init__(*args, **kwargs)
            self.lora = lora
            experts, hidden = self.weight.shape
            device = self.weight.device
            self.lora_A = torch.nn.Parameter(torch.zeros(lora.rank, hidden, dtype=self.weight.dtype, device=device))
            self.lora_B = torch.nn.Parameter(torch.zeros(experts, lora.rank, dtype=self.weight.dtype, device=device))
            for param in (self.lora_A, self.lora_B):
                param.sequence_parallel = self.config.sequence_parallel
            _tag_scale(self)

        def gating(self, input):
            logits = super().gating(input)
            x = _dropout(self, input.to(logits.dtype))
            return logits + F.linear(F.linear(x, self.lora_A.to(logits.dtype)), self.lora_B.to(logits.dtype)) \
                * self.lora.scale

    LoraRouter.__name__ = f"Lora{router_class.__name__}"
    return LoraRouter


# ---- where the adapters go --------------------------------------------------------------------

def _lora_linear(current, lora: LoraSettings, **params):
    """A ModuleSpec building the LoRA form of `current` (the local spec's parallel linear)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(current, ModuleSpec):  # already adapted (a spec shared by several layers)
        return current
    if current is ColumnParallelLinear:
        return ModuleSpec(module=LoraColumnParallelLinear, params=dict(lora=lora, **params))
    if current is RowParallelLinear:
        return ModuleSpec(module=LoraRowParallelLinear, params=dict(lora=lora))
    raise ValueError(f"LoRA is built on the local layer spec's parallel linears, not on {current!r}")


def _adapt_mlp(submodules, lora: LoraSettings, gated: bool, fc1: bool = True, fc2: bool = True) -> None:
    if fc1:
        submodules.linear_fc1 = _lora_linear(submodules.linear_fc1, lora, gated=gated)
    if fc2:
        submodules.linear_fc2 = _lora_linear(submodules.linear_fc2, lora)


# The `qkv` target: the fused Q/K/V projection, or multi-latent attention's query and key/value
# projections (the spec fields that exist in the attention's submodules; MLA builds linear_q_proj
# or the q down/up pair, as q_lora_rank says). MLA's down projections are adapted after the build
# (adapt_mla_down_projections).
QKV_PROJECTIONS = ("linear_qkv", "linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj")
MLA_DOWN_PROJECTIONS = ("linear_q_down_proj", "linear_kv_down_proj")


def apply_to_layer_spec(block, lora: LoraSettings, targets: list[str], gated: bool) -> None:
    """Put adapters on `targets` in every layer spec of `block` (in place)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    for spec in block.layer_specs:
        attention = spec.submodules.self_attention.submodules
        if "qkv" in targets:
            for field in QKV_PROJECTIONS:
                if hasattr(attention, field):
                    setattr(attention, field, _lora_linear(getattr(attention, field), lora))
        if "proj" in targets:
            attention.linear_proj = _lora_linear(attention.linear_proj, lora)
        mlp = spec.submodules.mlp
        moe = hasattr(mlp.submodules, "experts")
        dense = dict(fc1="fc1" in targets, fc2="fc2" in targets)
        if not moe:
            _adapt_mlp(mlp.submodules, lora, gated, **dense)
            continue
        if "experts" in targets:
            _adapt_mlp(mlp.submodules.experts.submodules, lora, gated)
        shared = getattr(mlp.submodules, "shared_experts", None)
        if shared is not None:
            _adapt_mlp(shared.submodules, lora, gated, **dense)
        if "router" in targets and not isinstance(mlp.submodules.router, ModuleSpec):
            mlp.submodules.router = ModuleSpec(module=lora_router(mlp.submodules.router), params=dict(lora=lora))


def adapt_mla_down_projections(module: torch.nn.Module, lora: LoraSettings) -> None:
    """Adapters on multi-latent attention's q and kv down projections, in the built model.

    Megatron-Core's MLASelfAttention picks their parallel mode by the spec's class, compared by
    identity with its own linear classes (any other spec is refused), so they cannot be given a
    LoRA spec. The built ColumnParallelLinear becomes a LoraColumnParallelLinear in place: the
    subclass adds parameters and overrides forward and sharded_state_dict, nothing in __init__
    that the base class's construction lacks. Column-parallel like the spec-built ones (B split on
    the latent outputs, which MLA gathers over TP itself)."""
    for layer in module.modules():
        for field in MLA_DOWN_PROJECTIONS:
            linear = getattr(layer, field, None)
            if linear is None or isinstance(linear, LoraColumnParallelLinear):
                continue
            if type(linear) is not ColumnParallelLinear or linear.gather_output:
                raise ValueError(f"LoRA on {field} is built on the local spec's ColumnParallelLinear "
                                 f"without gather_output, not on {type(linear).__name__}")
            linear.__class__ = LoraColumnParallelLinear
            linear.gated = False
            _add_adapters(linear, lora, linear.input_size, linear.output_size_per_partition, split="B")


def keep_layer_inputs_differentiable(module: torch.nn.Module) -> None:
    """With activation recomputation (model.recompute=full) Megatron wraps each layer in its
    CheckpointFunction, an autograd Function whose output requires grad only if one of its inputs
    does, and whose backward is what recomputes the layer and reaches its parameters. With the
    base frozen the embedding's output requires no grad, so on the first pipeline stage no layer
    ran its backward and the adapters got no gradient: grad norm 0 at every step, nothing trained.
    The embedding's output is made to require grad (what PEFT's enable_input_require_grads does
    for Hugging Face models); a later stage's input arrives from the previous stage requiring grad
    already. Only while grad is enabled: the logprob passes are left as they are."""
    embedding = getattr(module, "embedding", None)
    if embedding is None:  # not the first pipeline stage
        return

    def output_requires_grad(_module, _inputs, output):
        if torch.is_grad_enabled() and not output.requires_grad:
            output.requires_grad_(True)
        return output

    embedding.register_forward_hook(output_requires_grad)


def freeze_base(module: torch.nn.Module) -> None:
    """Only the adapters train: no gradient buffer, no optimizer state for anything else."""
    for name, param in module.named_parameters():
        param.requires_grad_(is_adapter(name))


# ---- initialization -------------------------------------------------------------------------

def _global_layer_names(module) -> dict[str, str]:
    """{local module-name prefix: global prefix} for layers and experts (Megatron numbers both from
    0 on every pipeline stage and EP rank)."""
    names = {}
    for index, layer in enumerate(getattr(getattr(module, "decoder", None), "layers", [])):
        names[f"decoder.layers.{index}."] = f"decoder.layers.{layer.layer_number - 1}."
        experts = getattr(getattr(layer, "mlp", None), "local_expert_indices", None)
        for local, global_id in enumerate(experts or []):
            names[f"decoder.layers.{index}.mlp.experts.local_experts.{local}."] = \
                f"decoder.layers.{layer.layer_number - 1}.mlp.experts.local_experts.{global_id}."
    return names


def global_name(name: str, prefixes: dict[str, str]) -> str:
    best = max((p for p in prefixes if name.startswith(p)), key=len, default=None)
    return name if best is None else prefixes[best] + name[len(best):]


def init_adapters(module, seed: int) -> None:
    """A drawn from a generator seeded by (seed, the adapter's global name), whole, then this
    rank's input slice kept (row-parallel): every layout starts from the same adapters. B = 0."""
    prefixes = _global_layer_names(module)
    for name, layer in module.named_modules():
        if not hasattr(layer, "lora_A"):
            continue
        a = layer.lora_A
        split = getattr(a, "tensor_model_parallel", False)
        group = getattr(layer, "tp_group", None)
        parts, rank = (group.size(), group.rank()) if split else (1, 0)
        digest = hashlib.sha256(f"{seed}:{global_name(name, prefixes)}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        full_in = a.shape[1] * parts
        if layer.lora.init == "gaussian":  # PEFT's init_lora_weights="gaussian"
            whole = torch.randn(a.shape[0], full_in, generator=generator) / layer.lora.rank
        else:  # PEFT's default: kaiming_uniform_(a=sqrt(5)) on [rank, in], bound 1/sqrt(in)
            bound = 1.0 / math.sqrt(full_in)
            whole = (torch.rand(a.shape[0], full_in, generator=generator) * 2 - 1) * bound
        with torch.no_grad():
            a.copy_(whole[:, rank * a.shape[1]:(rank + 1) * a.shape[1]])
            layer.lora_B.zero_()
