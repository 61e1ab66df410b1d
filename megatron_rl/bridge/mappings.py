"""Declarative Megatron <-> Hugging Face parameter tables, one per architecture family.

A table is a list of rules. Each rule names one Megatron parameter (with `{layer}` and `{expert}`
placeholders holding GLOBAL indices), the HF checkpoint tensors it corresponds to, and the layout
that relates them:

    plain    one HF tensor, same shape
    qkv      Megatron's fused QKV, grouped per KV head: [groups, (q_per_group + 2) * head_dim, ...]
             <-> HF q_proj, k_proj, v_proj (weights or biases)
    gate_up  Megatron's fused SwiGLU input [gate; up] <-> HF gate and up projections
    vocab    embedding / output rows, padded in Megatron to a multiple of 128 * TP; trimmed on
             export, zero-padded on import

Multi-latent attention (DeepSeek-V3) needs no fused layout: Megatron-Core's MLA projections hold
exactly HF's rows (q as [heads, nope + rope], kv_a as [kv_lora_rank; rope], kv_b as
[heads, nope + v]), and both read the rotary part of q/k in interleaved pairs. The router's
score-correction bias is a buffer, mapped like a parameter (bridge/placement.py).

HF names are the on-disk checkpoint format (per-expert tensors), which `save_pretrained` writes
and every rollout engine loads; transformers fuses experts in memory on its own.
This module is the only place that knows HF tensor names.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.errors import ConfigError
from megatron_rl.model.hf_config import FAMILIES, ArchitectureSpec


@dataclass(frozen=True)
class Rule:
    megatron: str
    hf: tuple[str, ...]
    layout: str = "plain"


L = "model.layers.{layer}"
M = "decoder.layers.{layer}"


def _rules(*items: tuple) -> list[Rule]:
    return [Rule(megatron, tuple(hf) if isinstance(hf, (list, tuple)) else (hf,), *layout) for megatron, hf, *layout in items]


EMBEDDING = _rules(
    ("embedding.word_embeddings.weight", "model.embed_tokens.weight", "vocab"),
    ("decoder.final_layernorm.weight", "model.norm.weight"),
)
OUTPUT = _rules(("output_layer.weight", "lm_head.weight", "vocab"))

ATTENTION = _rules(
    (f"{M}.input_layernorm.weight", f"{L}.input_layernorm.weight"),
    (f"{M}.self_attention.linear_qkv.weight",
     [f"{L}.self_attn.q_proj.weight", f"{L}.self_attn.k_proj.weight", f"{L}.self_attn.v_proj.weight"], "qkv"),
    (f"{M}.self_attention.linear_proj.weight", f"{L}.self_attn.o_proj.weight"),
    (f"{M}.pre_mlp_layernorm.weight", f"{L}.post_attention_layernorm.weight"),
)
QKV_BIAS = _rules(
    (f"{M}.self_attention.linear_qkv.bias",
     [f"{L}.self_attn.q_proj.bias", f"{L}.self_attn.k_proj.bias", f"{L}.self_attn.v_proj.bias"], "qkv"),
)
QK_NORM = _rules(
    (f"{M}.self_attention.q_layernorm.weight", f"{L}.self_attn.q_norm.weight"),
    (f"{M}.self_attention.k_layernorm.weight", f"{L}.self_attn.k_norm.weight"),
)
DENSE_MLP = _rules(
    (f"{M}.mlp.linear_fc1.weight", [f"{L}.mlp.gate_proj.weight", f"{L}.mlp.up_proj.weight"], "gate_up"),
    (f"{M}.mlp.linear_fc2.weight", f"{L}.mlp.down_proj.weight"),
)
E = f"{M}.mlp.experts.local_experts.{{expert}}"
QWEN3_MOE_EXPERTS = _rules(
    (f"{M}.mlp.router.weight", f"{L}.mlp.gate.weight"),
    (f"{E}.linear_fc1.weight",
     [f"{L}.mlp.experts.{{expert}}.gate_proj.weight", f"{L}.mlp.experts.{{expert}}.up_proj.weight"], "gate_up"),
    (f"{E}.linear_fc2.weight", f"{L}.mlp.experts.{{expert}}.down_proj.weight"),
)
MIXTRAL_EXPERTS = _rules(
    (f"{M}.mlp.router.weight", f"{L}.block_sparse_moe.gate.weight"),
    (f"{E}.linear_fc1.weight",
     [f"{L}.block_sparse_moe.experts.{{expert}}.w1.weight", f"{L}.block_sparse_moe.experts.{{expert}}.w3.weight"],
     "gate_up"),
    (f"{E}.linear_fc2.weight", f"{L}.block_sparse_moe.experts.{{expert}}.w2.weight"),
)

SIGMOID_ROUTER = _rules(
    (f"{M}.mlp.router.weight", f"{L}.mlp.gate.weight"),
    (f"{M}.mlp.router.expert_bias", f"{L}.mlp.gate.e_score_correction_bias"),
)
DEEPSEEK_EXPERTS = SIGMOID_ROUTER + _rules(
    (f"{E}.linear_fc1.weight",
     [f"{L}.mlp.experts.{{expert}}.gate_proj.weight", f"{L}.mlp.experts.{{expert}}.up_proj.weight"], "gate_up"),
    (f"{E}.linear_fc2.weight", f"{L}.mlp.experts.{{expert}}.down_proj.weight"),
)
SHARED_EXPERTS = _rules(
    (f"{M}.mlp.shared_experts.linear_fc1.weight",
     [f"{L}.mlp.shared_experts.gate_proj.weight", f"{L}.mlp.shared_experts.up_proj.weight"], "gate_up"),
    (f"{M}.mlp.shared_experts.linear_fc2.weight", f"{L}.mlp.shared_experts.down_proj.weight"),
)
NORMS = _rules(
    (f"{M}.input_layernorm.weight", f"{L}.input_layernorm.weight"),
    (f"{M}.pre_mlp_layernorm.weight", f"{L}.post_attention_layernorm.weight"),
)
A = f"{M}.self_attention"
MLA = _rules(
    (f"{A}.linear_kv_down_proj.weight", f"{L}.self_attn.kv_a_proj_with_mqa.weight"),
    (f"{A}.kv_layernorm.weight", f"{L}.self_attn.kv_a_layernorm.weight"),
    (f"{A}.linear_kv_up_proj.weight", f"{L}.self_attn.kv_b_proj.weight"),
    (f"{A}.linear_proj.weight", f"{L}.self_attn.o_proj.weight"),
)
MLA_Q = _rules((f"{A}.linear_q_proj.weight", f"{L}.self_attn.q_proj.weight"))
MLA_Q_LORA = _rules(
    (f"{A}.linear_q_down_proj.weight", f"{L}.self_attn.q_a_proj.weight"),
    (f"{A}.q_layernorm.weight", f"{L}.self_attn.q_a_layernorm.weight"),
    (f"{A}.linear_q_up_proj.weight", f"{L}.self_attn.q_b_proj.weight"),
)

# family -> (rules for every model, rules for dense layers, rules for MoE layers)
TABLES: dict[str, tuple[list[Rule], list[Rule], list[Rule]]] = {
    "qwen3_moe": (EMBEDDING + OUTPUT + ATTENTION + QK_NORM, DENSE_MLP, QWEN3_MOE_EXPERTS),
    "qwen3": (EMBEDDING + OUTPUT + ATTENTION + QK_NORM, DENSE_MLP, []),
    "qwen2": (EMBEDDING + OUTPUT + ATTENTION + QKV_BIAS, DENSE_MLP, []),
    "llama": (EMBEDDING + OUTPUT + ATTENTION, DENSE_MLP, []),
    "mixtral": (EMBEDDING + OUTPUT + ATTENTION, DENSE_MLP, MIXTRAL_EXPERTS),
    # Attention rules for these two depend on the config (q_lora_rank, attention_bias,
    # use_qk_norm): `rules_for` adds them.
    "deepseek_v3": (EMBEDDING + OUTPUT + NORMS, DENSE_MLP, DEEPSEEK_EXPERTS + SHARED_EXPERTS),
    "glm4_moe": (EMBEDDING + OUTPUT + ATTENTION, DENSE_MLP, DEEPSEEK_EXPERTS + SHARED_EXPERTS),
}


def rules_for(arch: ArchitectureSpec) -> list[Rule]:
    """Every rule that applies to this model (before expanding layers and experts)."""
    if arch.family not in TABLES:
        supported = ", ".join(FAMILIES)
        raise ConfigError(f"no bridge mapping for {arch.architecture}; supported: {supported}")
    common, dense, moe = _table(arch)
    rules = [r for r in common if not (arch.tie_word_embeddings and r.megatron == "output_layer.weight")]
    if arch.qkv_bias and not any(r.megatron.endswith("linear_qkv.bias") for r in rules):
        raise ConfigError(f"{arch.architecture} with QKV bias has no bias mapping")  # table bug guard
    return rules + dense + moe


def _table(arch: ArchitectureSpec) -> tuple[list[Rule], list[Rule], list[Rule]]:
    common, dense, moe = TABLES[arch.family]
    if arch.mla is not None:
        common = common + MLA + (MLA_Q if arch.mla.q_lora_rank is None else MLA_Q_LORA)
    elif arch.family == "glm4_moe":
        common = common + (QKV_BIAS if arch.qkv_bias else []) + (QK_NORM if arch.qk_norm else [])
    if arch.moe_shared_ffn_hidden_size is None:
        moe = [r for r in moe if r not in SHARED_EXPERTS]
    return common, dense, moe


def expand(arch: ArchitectureSpec) -> list[tuple[str, tuple[str, ...], str]]:
    """(global Megatron name, HF names, layout) for every parameter of the full model."""
    common, dense, moe = _table(arch)
    out = []
    for rule in rules_for(arch):
        if "{layer}" not in rule.megatron:
            out.append((rule.megatron, rule.hf, rule.layout))
            continue
        for layer in range(arch.num_layers):
            sparse = arch.is_moe and arch.moe_layer_pattern[layer]
            if (rule in dense and sparse) or (rule in moe and not sparse):
                continue
            experts = range(arch.num_experts) if "{expert}" in rule.megatron else [None]
            for expert in experts:
                fill = dict(layer=layer, expert=expert)
                out.append((rule.megatron.format(**fill), tuple(h.format(**fill) for h in rule.hf), rule.layout))
    return out
