"""Bridge tables and name handling that need no model (pure functions)."""

import pytest

from megatron_rl.bridge.mappings import expand
from megatron_rl.bridge.placement import canonical_name
from megatron_rl.config import ConfigError
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
    ],
)
def test_transformer_engine_names_map_to_the_local_layout(te_name, local_name):
    assert canonical_name(te_name) == local_name


def test_tables_cover_each_family_once():
    for preset in ("tiny-qwen3-moe", "tiny-qwen3", "tiny-llama"):
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
