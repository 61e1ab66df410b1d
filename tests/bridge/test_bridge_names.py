"""Bridge tables and name handling that need no model (pure functions)."""

import pytest

from megatron_rl.bridge.mappings import expand
from megatron_rl.bridge.placement import canonical_name
from megatron_rl.errors import ConfigError
from megatron_rl.model.hf_config import load_hf_config, parse_hf_config


@pytest.mark.parametrize(
    "te_name, local_name",
    [
        ("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.3.input_layernorm.weight"),
        ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "decoder.layers.0.pre_mlp_layernorm.weight"),
        ("decoder.layers.1.mlp.experts.linear_fc1.weight7", "decoder.layers.1.mlp.experts.local_experts.7.linear_fc1.weight"),
        ("decoder.layers.1.mlp.experts.linear_fc2.weight12", "decoder.layers.1.mlp.experts.local_experts.12.linear_fc2.weight"),
        ("decoder.layers.1.self_attention.linear_qkv.weight", "decoder.layers.1.self_attention.linear_qkv.weight"),
        ("decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight", "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"),
        # Multi-latent attention: TE fuses the latent norms into the up-projections.
        ("decoder.layers.2.self_attention.linear_q_up_proj.layer_norm_weight", "decoder.layers.2.self_attention.q_layernorm.weight"),
        ("decoder.layers.2.self_attention.linear_kv_up_proj.layer_norm_weight", "decoder.layers.2.self_attention.kv_layernorm.weight"),
        ("decoder.layers.2.self_attention.linear_kv_up_proj.weight", "decoder.layers.2.self_attention.linear_kv_up_proj.weight"),
    ],
)
def test_transformer_engine_names_map_to_the_local_layout(te_name, local_name):
    assert canonical_name(te_name) == local_name


def test_tables_cover_each_family_once():
    for preset in ("tiny-qwen3-moe", "tiny-qwen3", "tiny-llama", "tiny-deepseek-v3", "tiny-glm4-moe"):
        arch = parse_hf_config(*load_hf_config(preset))
        entries = expand(arch)
        hf_names = [n for _, names, _ in entries for n in names]
        assert len(hf_names) == len(set(hf_names)), "an HF tensor is mapped twice"
        megatron_names = [m for m, _, _ in entries]
        assert len(megatron_names) == len(set(megatron_names))
    tied = parse_hf_config(*load_hf_config("tiny-qwen3"))
    assert "lm_head.weight" not in {n for _, names, _ in expand(tied) for n in names}


def test_moe_layer_pattern_picks_dense_or_expert_rules():
    raw, _ = load_hf_config("tiny-qwen3-moe")
    arch = parse_hf_config(dict(raw, mlp_only_layers=[1]))
    names = {m for m, _, _ in expand(arch)}
    assert "decoder.layers.0.mlp.router.weight" in names and "decoder.layers.1.mlp.router.weight" not in names
    assert "decoder.layers.1.mlp.linear_fc1.weight" in names and "decoder.layers.0.mlp.linear_fc1.weight" not in names
    assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight" in names


def test_unknown_family_is_refused():
    from dataclasses import replace

    from megatron_rl.bridge.mappings import rules_for

    arch = replace(parse_hf_config(*load_hf_config("tiny-llama")), family="gpt2", architecture="GPT2LMHeadModel")
    with pytest.raises(ConfigError, match="no bridge mapping for GPT2LMHeadModel; supported: Qwen3MoeForCausalLM"):
        rules_for(arch)


def test_sigmoid_router_families_map_bias_shared_experts_and_dense_layers():
    deepseek = parse_hf_config(*load_hf_config("tiny-deepseek-v3"))  # layer 0 dense, layer 1 MoE
    names = {m: hf for m, hf, _ in expand(deepseek)}
    assert names["decoder.layers.1.mlp.router.expert_bias"] == ("model.layers.1.mlp.gate.e_score_correction_bias",)
    assert names["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"] == (
        "model.layers.1.mlp.shared_experts.gate_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight")
    assert "decoder.layers.0.mlp.linear_fc1.weight" in names and "decoder.layers.0.mlp.router.weight" not in names
    assert names["decoder.layers.0.self_attention.linear_q_up_proj.weight"] == ("model.layers.0.self_attn.q_b_proj.weight",)
    raw, _ = load_hf_config("tiny-deepseek-v3")
    without_q_lora = {m for m, _, _ in expand(parse_hf_config(dict(raw, q_lora_rank=None)))}
    assert "decoder.layers.0.self_attention.linear_q_proj.weight" in without_q_lora
    assert "decoder.layers.0.self_attention.q_layernorm.weight" not in without_q_lora
    glm_raw, _ = load_hf_config("tiny-glm4-moe")
    plain = {m for m, _, _ in expand(parse_hf_config(dict(glm_raw, attention_bias=False, use_qk_norm=False)))}
    assert not any(n.endswith(("linear_qkv.bias", "q_layernorm.weight")) for n in plain)
    full = {m for m, _, _ in expand(parse_hf_config(glm_raw))}
    assert {"decoder.layers.0.self_attention.linear_qkv.bias", "decoder.layers.0.self_attention.q_layernorm.weight"} <= full
