"""HF config.json -> ArchitectureSpec, for every supported family, and the refusals."""

import json

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.model.hf_config import FAMILIES, PRESETS, load_hf_config, parse_hf_config


def preset(name):
    return load_hf_config(name)[0]


@pytest.mark.parametrize("name", PRESETS)
def test_presets_parse(name):
    spec = parse_hf_config(preset(name), name)
    assert spec.architecture in FAMILIES


def test_qwen3_moe_fields():
    raw = dict(preset("tiny-qwen3-moe"), mlp_only_layers=[0], norm_topk_prob=False)
    spec = parse_hf_config(raw)
    assert spec.family == "qwen3_moe" and spec.qk_norm and not spec.qkv_bias
    assert (spec.num_experts, spec.moe_top_k, spec.moe_ffn_hidden_size) == (4, 2, 64)
    assert spec.moe_layer_pattern == (False, True)
    assert spec.moe_norm_topk_prob is False
    assert spec.head_dim == 32


def test_transformers5_spellings():
    raw = dict(preset("tiny-qwen3-moe"))
    raw.pop("rope_theta")
    raw["rope_parameters"] = {"rope_theta": 5e5, "rope_type": "default"}
    raw["num_local_experts"] = raw.pop("num_experts")
    spec = parse_hf_config(raw)
    assert spec.rope_theta == 5e5 and spec.num_experts == 4


def test_family_specific_defaults():
    base = preset("tiny-llama")
    qwen2 = parse_hf_config(dict(base, architectures=["Qwen2ForCausalLM"]))
    assert qwen2.qkv_bias and not qwen2.qk_norm
    mixtral = parse_hf_config(dict(base, architectures=["MixtralForCausalLM"], num_local_experts=8, num_experts_per_tok=2))
    assert mixtral.moe_norm_topk_prob and mixtral.moe_ffn_hidden_size == base["intermediate_size"]
    assert mixtral.moe_layer_pattern == (True, True)
    assert parse_hf_config(preset("tiny-qwen3")).tie_word_embeddings


@pytest.mark.parametrize(
    "change, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "'GPT2LMHeadModel' is not supported; supported: Qwen3MoeForCausalLM"),
        ({"architectures": []}, "must name exactly one of"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn' is not supported"),
        ({"use_sliding_window": True, "sliding_window": 128}, "sliding_window=128 is not supported"),
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3 is not supported"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 is not supported"),
        ({"mlp_only_layers": [5]}, "mlp_only_layers has layer ids outside"),
    ],
)
def test_refusals_name_key_and_value(change, message):
    raw = dict(preset("tiny-qwen3-moe"), **change)
    with pytest.raises(ConfigError) as info:
        parse_hf_config(raw, "some/config.json")
    assert message in str(info.value) and "some/config.json" in str(info.value)


def test_missing_required_key():
    raw = preset("tiny-qwen3")
    raw.pop("hidden_size")
    with pytest.raises(ConfigError, match="required key 'hidden_size' is missing"):
        parse_hf_config(raw)


def test_load_from_directory_and_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(preset("tiny-qwen3")))
    raw, where = load_hf_config(tmp_path)
    assert raw["architectures"] == ["Qwen3ForCausalLM"] and where.endswith("config.json")
    with pytest.raises(ConfigError, match="neither a preset"):
        load_hf_config(tmp_path / "missing")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{oops")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_hf_config(tmp_path / "bad")
