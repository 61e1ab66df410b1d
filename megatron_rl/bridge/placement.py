"""Where each local parameter of a (sharded) Megatron model sits in the full model.

Megatron names layers per pipeline stage from 0 and experts per EP rank from 0. The global
names come from each layer's `layer_number` (1-based, global) and each MoE layer's
`local_expert_indices`. Tensor-parallel splitting comes from the attributes Megatron puts on
every parameter (`tensor_model_parallel`, `partition_dim`), except for expert linears (below).
Expert parameters, recognized by name, are split over the expert-tensor-parallel group instead
of the TP group and spread over the expert-parallel group.

Both layer specs are accepted: the local spec (one module per expert) and Transformer Engine's
(norms fused into the next linear, grouped-GEMM experts as one module with weight0..weightN-1).
Names are canonicalized to the local spec's, which the mapping tables use, so both layouts
export exactly the same HF tensors.

Besides parameters, the model state includes the MoE routers' expert bias (model/state.py):
imported, exported and pushed to rollout engines like a parameter (replicated on every rank of
the layer's stage).

LoRA adapters (`lora_A`, `lora_B`) are no placements of their own: they belong to the weight
they adapt (`Placement.adapter`), so everything that reads HF names sees the base model's names,
and the export merges them in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from megatron_rl.model.state import is_adapter, model_state


@dataclass
class Placement:
    local_name: str
    global_name: str
    param: torch.Tensor
    is_expert: bool
    local_expert: int | None  # index among this rank's experts (same on every EP rank)
    tp_dim: int | None  # dimension split over the (expert-)TP group, None if replicated
    tp_group: object | None
    ep_group: object | None
    # LoRA (model/lora.py): (A, B, alpha / rank) of the adapter on this weight, this rank's shards,
    # sharded as the weight is; the export yields W + scale * B A (bridge/lora_merge.py).
    adapter: tuple[torch.Tensor, torch.Tensor, float] | None = None


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")

# Transformer Engine's layer spec names the same tensors differently: norms are fused into the
# following linear, and grouped experts are one module with weight0..weightN-1 (TEGroupedMLP,
# one weight per local expert). TE modules cannot be built without CUDA, so this is checked on
# names (tests/bridge/test_bridge_names.py) and on a local-spec model whose parameters are renamed
# and re-tagged the way TE names and tags them (tests/bridge/test_grouped_experts.py).
_TE_NAMES = [
    (re.compile(r"\.self_attention\.linear_qkv\.layer_norm_weight$"), ".input_layernorm.weight"),
    (re.compile(r"\.mlp\.linear_fc1\.layer_norm_weight$"), ".pre_mlp_layernorm.weight"),
    # Multi-latent attention: the latent norms are fused into the up-projections.
    (re.compile(r"\.self_attention\.linear_q_up_proj\.layer_norm_weight$"), ".self_attention.q_layernorm.weight"),
    (re.compile(r"\.self_attention\.linear_kv_up_proj\.layer_norm_weight$"), ".self_attention.kv_layernorm.weight"),
    (re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$"), r".mlp.experts.local_experts.\2.\1.weight"),
]


# Dimension each expert linear's weight is split along over expert-TP, by role (column-parallel
# fc1, row-parallel fc2). Not read from `partition_dim`: when Megatron does the expert
# communication itself (expert-TP > 1 or EP > 1) it builds TE's expert linears, grouped or not,
# with parallel_mode=None, and TE then tags every weight partition_dim=0, fc2 included.
_EXPERT_LINEAR = re.compile(r"\.mlp\.experts\.local_experts\.\d+\.(linear_fc[12])\.weight$")
_EXPERT_TP_DIM = {"linear_fc1": 0, "linear_fc2": 1}


def canonical_name(name: str) -> str:
    """The local-spec name of a parameter named by either layer spec."""
    for pattern, replacement in _TE_NAMES:
        name = pattern.sub(replacement, name)
    return name


def tp_split_dim(name: str, param: torch.Tensor) -> int | None:
    """The dimension a parameter (canonical name) is split along over its TP group, or None."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    expert_linear = _EXPERT_LINEAR.search(name)
    if expert_linear:
        return _EXPERT_TP_DIM[expert_linear.group(1)]
    return getattr(param, "partition_dim", None)


def placements(module) -> list[Placement]:
    """One Placement per parameter of this rank's model chunk, in a rank-independent order."""
    from megatron.core import parallel_state

    layers = module.decoder.layers if hasattr(module, "decoder") else []
    layer_global = {index: layer.layer_number - 1 for index, layer in enumerate(layers)}
    out = []
    state = model_state(module)
    by_name = dict(state)
    for name, param in state:
        if is_adapter(name):
            continue
        adapter = _adapter_of(by_name, name)
        name = canonical_name(name)
        global_name = name
        local_expert = None
        layer_match = _LAYER.match(name)
        if layer_match:
            local_layer = int(layer_match.group(1))
            global_name = _LAYER.sub(f"decoder.layers.{layer_global[local_layer]}.", global_name, count=1)
            expert_match = _EXPERT.search(name)
            if expert_match:
                local_expert = int(expert_match.group(1))
                experts = layers[local_layer].mlp.local_expert_indices
                global_name = _EXPERT.sub(f".mlp.experts.local_experts.{experts[local_expert]}.", global_name, count=1)
        # By name, not by `allreduce`: Megatron marks expert weights allreduce=False only when
        # EP > 1, yet with EP = 1 they are still split over the expert-TP group (etp may differ from tp).
        is_expert = local_expert is not None
        split_dim = tp_split_dim(name, param)
        tp_group = (
            parallel_state.get_expert_tensor_parallel_group() if is_expert else parallel_state.get_tensor_model_parallel_group()
        )
        out.append(
            Placement(
                local_name=name,
                global_name=global_name,
                param=param,
                is_expert=is_expert,
                local_expert=local_expert,
                tp_dim=split_dim if tp_group.size() > 1 else None,
                tp_group=tp_group,
                ep_group=parallel_state.get_expert_model_parallel_group() if is_expert else None,
                adapter=adapter,
            )
        )
    return out


def _adapter_of(by_name: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """(A, B, scale) of the LoRA adapter beside the weight `name` (the model's own names), or None."""
    owner, _, leaf = name.rpartition(".")
    a = by_name.get(f"{owner}.lora_A") if leaf == "weight" else None
    if a is None:
        return None
    return a, by_name[f"{owner}.lora_B"], a.lora_scale
