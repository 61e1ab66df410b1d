"""LoRA adapters as a PEFT directory: adapter_config.json + adapter_model.safetensors.

    tensors = peft_tensors(adapters, arch)        # {Megatron weight name: (A, B)}, whole -> PEFT names
    write_peft_directory(adapters, arch, settings, directory)

`peft.PeftModel.from_pretrained(hf_base, directory)` then loads the adapters on the Hugging Face
base model, and its forward is the merged model's (W + (alpha / rank) B A, what bridge/export.py
writes as hf_model/).

Megatron fuses projections that HF (and so PEFT) keeps apart. A fused column-parallel adapter has
one A [rank, in] and one B [out, rank] whose rows are fused like W's (model/lora.py), so the
delta B A has W's fused row layout: the q rows of B A are B_q A, where B_q is B's q rows taken
with W's own split (bridge/layouts.py). Each HF projection (q/k/v; gate/up) therefore gets the
same A and its slice of B, with the same scale, and W_q + s B_q A is exactly the q rows of the
fused merge. Row-parallel adapters (o_proj, down_proj) map one to one.

Experts and router: PEFT's names for a MoE family's experts are the on-disk per-expert modules
(`mlp.experts.N.gate_proj` for Qwen3-MoE, DeepSeek-V3 and GLM-4.5; `block_sparse_moe.experts.N.w1`
for Mixtral) and the router's is `mlp.gate` (`block_sparse_moe.gate`), the modules transformers
< 5 had in memory; PEFT (0.21) converts them on load to transformers 5's fused expert tensors and
router parameter (target `gate_proj` or `w1` -> the experts' `gate_up_proj`, with the gate and up
adapters stacked to rank 2r, and `gate` -> `gate.weight`, the sigmoid routers' too). Multi-latent
attention (DeepSeek-V3): `qkv` is its q_a_proj / q_b_proj (or q_proj), kv_a_proj_with_mqa and
kv_b_proj, each a plain mapping like o_proj.

What PEFT cannot represent, refused by name: in a MoE family whose experts and dense MLPs share
leaf names (Qwen3-MoE, DeepSeek-V3, GLM-4.5: `gate_proj`, `up_proj`, `down_proj`), adapters on a
dense layer's MLP or on the shared experts (targets `fc1`, `fc2`). PEFT turns every such
target into the experts' fused parameter, so the dense MLP's adapters would be dropped on load
(tried: the PEFT model is then the base model exactly). Mixtral has no dense MLP.

The tensors are whole: the caller reads them from a checkpoint at TP1/EP1 (tools/convert.py,
bridge/streamed.py reads torch_dist at any saved layout), or gathers them from the live sharded
model (`gathered_adapters`, the adapter-only weight push: attention and dense MLP adapters).

This module owns the PEFT names: `peft_table` (Megatron weight -> its PEFT modules and layout) is
what the export writes and what the import (bridge/peft_import.py) inverts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_rl.bridge.layouts import merge, split
from megatron_rl.bridge.mappings import expand
from megatron_rl.errors import ConfigError
from megatron_rl.model.hf_config import ArchitectureSpec

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel's prefix for the wrapped model's module names
Adapters = dict[str, tuple[torch.Tensor, torch.Tensor]]  # Megatron weight name -> (A, B), whole
# model.lora's targets (config/model.py) -> the Megatron weights each adapts (model/lora.py), by name
# suffix; `experts` adapts the routed experts' linears, `fc1` / `fc2` the dense MLP's and the shared experts'.
TARGET_WEIGHTS = {
    # Multi-latent attention's query and key/value projections: q_proj or q_a_proj / q_b_proj,
    # kv_a_proj_with_mqa, kv_b_proj in HF (and PEFT) names.
    "qkv": (".self_attention.linear_qkv.weight", ".self_attention.linear_q_proj.weight",
            ".self_attention.linear_q_down_proj.weight", ".self_attention.linear_q_up_proj.weight",
            ".self_attention.linear_kv_down_proj.weight", ".self_attention.linear_kv_up_proj.weight"),
    "proj": (".self_attention.linear_proj.weight",),
    "fc1": (".mlp.linear_fc1.weight", ".mlp.shared_experts.linear_fc1.weight"),
    "fc2": (".mlp.linear_fc2.weight", ".mlp.shared_experts.linear_fc2.weight"),
    "experts": (".linear_fc1.weight", ".linear_fc2.weight"),
    "router": (".mlp.router.weight",),
}


def lora_target(name: str) -> str | None:
    """The model.lora target that adapts Megatron weight `name` (None: no target adapts it)."""
    expert = ".local_experts." in name
    return next((target for target, suffixes in TARGET_WEIGHTS.items()
                 if name.endswith(suffixes) and expert == (target == "experts")), None)


def peft_module(hf_name: str) -> str:
    """PEFT's name of the module holding HF weight `hf_name`: model.layers.0.self_attn.q_proj.weight ->
    base_model.model.model.layers.0.self_attn.q_proj (its tensors: MODULE.lora_A.weight, MODULE.lora_B.weight)."""
    return PREFIX + hf_name.removesuffix(".weight")


def peft_table(arch: ArchitectureSpec) -> dict[str, tuple[tuple[str, ...], str]]:
    """{Megatron weight name: (its PEFT module names, the layout fusing them)} for every weight a
    model.lora target adapts in this model."""
    return {name: (tuple(peft_module(hf) for hf in hf_names), layout)
            for name, hf_names, layout in expand(arch) if lora_target(name)}


def peft_tensors(adapters: Adapters, arch: ArchitectureSpec) -> dict[str, torch.Tensor]:
    """PEFT's lora_A / lora_B tensors (PEFT names) of `adapters` (Megatron's global weight names)."""
    table = {name: (hf, layout) for name, hf, layout in expand(arch)}
    modules = peft_table(arch)
    out = {}
    for name, (a, b) in sorted(adapters.items()):
        refuse_unrepresentable(name, table)
        names, layout = modules[name]
        # B's rows are fused like W's; A is shared by every piece.
        for module, b_piece in zip(names, split(layout, b.detach(), arch)):
            out[f"{module}.lora_A.weight"] = a.detach().clone().contiguous()  # one storage per tensor
            out[f"{module}.lora_B.weight"] = b_piece.clone().contiguous()
    return out


def gathered_adapters(module, arch: ArchitectureSpec) -> Adapters:
    """Every adapter of the live model, whole on every rank of its stage: the TP shards gathered
    (every rank of the TP group takes part) and put back in the fused layout a one-process model
    has. Column-parallel B is split on W's rows (each rank's shard fused on its own, as W's is),
    row-parallel A on W's columns. Experts' adapters (split over EP) are not gathered here."""
    from megatron_rl.bridge.export import _all_gather
    from megatron_rl.bridge.placement import placements

    table = {name: layout for name, _, layout in expand(arch)}
    out = {}
    for placement in placements(module):
        if placement.adapter is None:
            continue
        if placement.is_expert:
            raise ConfigError(f"the adapter on {placement.global_name} (an expert's) is not gathered for an "
                              "adapter-only push; train without the experts target")
        a, b, _ = (t.detach() if isinstance(t, torch.Tensor) else t for t in placement.adapter)
        if placement.tp_dim == 0:  # column-parallel: B's rows split like W's, each shard fused on its own
            layout = table[placement.global_name]
            shards = [split(layout, shard, arch) for shard in _all_gather(b, placement.tp_group)]
            b = merge(layout, [torch.cat(pieces, dim=0) for pieces in zip(*shards)], arch)
        elif placement.tp_dim == 1:  # row-parallel: A's columns split like W's
            a = torch.cat(_all_gather(a, placement.tp_group), dim=1)
        out[placement.global_name] = (a, b)
    return out


def refuse_unrepresentable(name: str, table: dict) -> None:
    """A Megatron adapter PEFT cannot load on the HF model, refused by name."""
    if name not in table or lora_target(name) is None:
        raise ConfigError(f"the adapter on {name} has no Hugging Face mapping for this model")
    if ".local_experts." in name:
        return
    expert_leaves = {_leaf(hf) for hf_names, _ in table.values() for hf in hf_names if ".experts." in hf}
    clash = sorted(expert_leaves.intersection(_leaf(hf) for hf in table[name][0]))
    if clash:
        raise ConfigError(f"the adapter on {name} (targets fc1/fc2 on a dense MLP or shared experts) has no PEFT "
                          f"form for this model: PEFT converts the target {clash[0]} to the experts' fused "
                          "parameter for this family and would drop it on load; train with model.lora.targets "
                          "without fc1 and fc2, or use the merged Hugging Face export")


def _leaf(hf_name: str) -> str:
    """The HF module's own name: model.layers.0.mlp.gate_proj.weight -> gate_proj."""
    return hf_name.rsplit(".", 2)[-2]


def target_modules(tensors: dict[str, torch.Tensor]) -> list[str]:
    """PEFT's target_modules: the HF module leaf names the adapters sit on (q_proj, gate_proj, ...)."""
    return sorted({key.rsplit(".", 3)[-3] for key in tensors})


def adapter_config(tensors: dict[str, torch.Tensor], rank: int, alpha: float, dropout: float,
                   base_model: str | None) -> dict:
    """adapter_config.json: PEFT's scaling lora_alpha / r is the run's alpha / rank."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": target_modules(tensors),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "modules_to_save": None,
    }


def write_peft_directory(adapters: Adapters, arch: ArchitectureSpec, rank: int, alpha: float, dropout: float,
                         directory: Path, base_model: str | None = None) -> list[str]:
    """adapter_config.json and adapter_model.safetensors in `directory` (it exists). Returns the
    files written. Everything is checked (and refused by name) before the first file is written.
    `base_model`: base_model_name_or_path, the base the adapters were trained on (a run's export
    finds it: tools/convert_lora.trained_base; PEFT on another base is another model)."""
    from safetensors.torch import save_file

    if not adapters:
        raise ConfigError("no LoRA adapters to export: the checkpoint holds none (was model.lora set for the run?)")
    tensors = peft_tensors(adapters, arch)
    directory = Path(directory)
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = adapter_config(tensors, rank, alpha, dropout, base_model)
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return [ADAPTER_WEIGHTS, ADAPTER_CONFIG]
