"""HF config.json -> ArchitectureSpec, for every supported family, and the refusals."""

import json

import pytest

from megatron_rl.errors import ConfigError
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


def test_deepseek_v3_fields():
    spec = parse_hf_config(preset("tiny-deepseek-v3"))
    assert spec.family == "deepseek_v3" and spec.mla is not None and spec.yarn is None
    assert (spec.mla.q_lora_rank, spec.mla.kv_lora_rank, spec.mla.qk_head_dim, spec.mla.v_head_dim) == (32, 512, 96, 32)
    assert spec.head_dim == 96 and spec.num_key_value_heads == spec.num_attention_heads
    assert (spec.moe_router_score, spec.moe_expert_bias, spec.moe_num_groups, spec.moe_group_topk) == ("sigmoid", True, 4, 2)
    assert spec.moe_routed_scaling_factor == 2.5 and spec.moe_shared_ffn_hidden_size == 64
    assert spec.moe_layer_pattern == (False, True)  # first_k_dense_replace=1
    no_groups = parse_hf_config(dict(preset("tiny-deepseek-v3"), n_group=1, topk_group=1))
    assert no_groups.moe_num_groups is None and no_groups.moe_group_topk is None


def test_glm4_moe_fields():
    spec = parse_hf_config(preset("tiny-glm4-moe"))
    assert spec.family == "glm4_moe" and spec.mla is None and spec.qkv_bias and spec.qk_norm
    assert spec.rotary_percent == 0.5 and spec.moe_router_score == "sigmoid" and spec.moe_num_groups is None
    plain = parse_hf_config(dict(preset("tiny-glm4-moe"), attention_bias=False, use_qk_norm=False))
    assert not plain.qkv_bias and not plain.qk_norm


def test_yarn_attention_factor_as_megatron_takes_it():
    """Megatron scales cos/sin by get_mscale(f, mscale) / get_mscale(f, mscale_all_dim); HF by that
    quotient only when both keys are given, else by get_mscale(f) (transformers' rule)."""
    import math

    def get_mscale(factor, m=1.0):
        return 0.1 * m * math.log(factor) + 1.0

    both = dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=0.8, mscale_all_dim=0.6)
    spec = parse_hf_config(dict(preset("tiny-deepseek-v3"), rope_scaling=both)).yarn
    assert (spec.mscale, spec.mscale_all_dim, spec.original_max_position_embeddings) == (0.8, 0.6, 4096)
    only_all_dim = dict(both, mscale=None)
    spec = parse_hf_config(dict(preset("tiny-deepseek-v3"), rope_scaling=only_all_dim)).yarn
    assert spec.mscale_all_dim == 0.6
    megatron_factor = get_mscale(40.0, spec.mscale) / get_mscale(40.0, spec.mscale_all_dim)
    assert megatron_factor == pytest.approx(get_mscale(40.0), rel=1e-12)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"norm_topk_prob": False}, "norm_topk_prob=False is not supported"),
        ({"rope_interleave": False}, "rope_interleave=False is not supported"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
        ({"n_group": 3}, "n_group=3 is not supported (must divide the 8 routed experts)"),
        ({"topk_group": 5}, "topk_group=5 is not supported"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config="),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type='linear' is not supported"),
    ],
)
def test_deepseek_refusals(change, message):
    with pytest.raises(ConfigError) as info:
        parse_hf_config(dict(preset("tiny-deepseek-v3"), **change), "ds/config.json")
    assert message in str(info.value) and "ds/config.json" in str(info.value)


def test_fp8_block_and_implied_engine_keys():
    from megatron_rl.model.hf_config import with_implied_keys

    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    raw = dict(preset("tiny-deepseek-v3"), quantization_config=quant, num_nextn_predict_layers=1)
    spec = parse_hf_config(raw)
    assert spec.fp8_block == (128, 128) and spec.num_mtp_layers == 1
    completed = with_implied_keys(raw, spec)
    assert (completed["topk_method"], completed["scoring_func"]) == ("noaux_tc", "sigmoid")
    assert with_implied_keys(dict(raw, scoring_func="sigmoid", topk_method="noaux_tc"), spec) == completed
    glm = preset("tiny-glm4-moe")
    assert with_implied_keys(glm, parse_hf_config(glm)) == glm


def test_expert_bias_rate_needs_a_biased_router():
    from megatron_rl.config import load_config
    from megatron_rl.model.layout_checks import check_divisibility

    config = load_config(None, ["model.moe_router_bias_update_rate=0.001"])  # the tiny Qwen3-MoE default
    with pytest.raises(ConfigError, match="moe_router_bias_update_rate=0.001 needs a router with an expert bias"):
        check_divisibility(parse_hf_config(preset("tiny-qwen3-moe")), config)
    check_divisibility(parse_hf_config(preset("tiny-deepseek-v3")), config)


def test_uneven_pipeline_stages():
    from megatron_rl.config import load_config
    from megatron_rl.model.layout_checks import check_divisibility

    arch = parse_hf_config(dict(preset("tiny-deepseek-v3"), num_hidden_layers=61))
    with pytest.raises(ConfigError, match="num_hidden_layers=61 is not divisible by parallel.pp=4"):
        check_divisibility(arch, load_config(None, ["parallel.pp=4"]))
    check_divisibility(arch, load_config(None, ["parallel.pp=4", "parallel.pp_last_stage_layers=13"]))
    with pytest.raises(ConfigError, match="do not split the model's 61 layers"):
        check_divisibility(arch, load_config(None, ["parallel.pp=4", "parallel.pp_last_stage_layers=12"]))
    with pytest.raises(ConfigError, match="needs pp > 1"):
        load_config(None, ["parallel.pp_first_stage_layers=2"])


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": 10**30}, "num_hidden_layers=1000000000000000000000000000000 is beyond 4096, the most it is "
                                    "read with"),
    ({"num_hidden_layers": 1e30}, "num_hidden_layers=1e+30 must be a positive integer"),
    ({"max_position_embeddings": 2**40}, "max_position_embeddings=1099511627776 is beyond 268435456"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 10**20}},
     "rope_scaling.original_max_position_embeddings=100000000000000000000 is beyond"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings='false' must be true or false"),
    ({"norm_topk_prob": 1}, "norm_topk_prob=1 must be true or false"),
    ({"mlp_only_layers": ["0"]}, "mlp_only_layers=['0'] must be a list of layer ids (integers)"),
    ({"sliding_window": "4096"}, "sliding_window='4096' must be a positive integer"),
])
def test_config_json_values_beyond_any_model_or_of_the_wrong_kind_are_refused_by_key(change, message):
    import signal

    def expired(*_):  # 10^30 layers were counted out one by one (60 s and 2.7 GB in `plan`): fail, not hang
        raise TimeoutError("parse_hf_config still running after 5 s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(5)
    try:
        with pytest.raises(ConfigError) as info:
            parse_hf_config(dict(preset("tiny-qwen3-moe"), **change), "some/config.json")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert str(info.value).startswith("some/config.json: ") and message in str(info.value), str(info.value)


def test_a_block_size_of_the_wrong_kind_is_refused():
    raw = dict(preset("tiny-deepseek-v3"), quantization_config={"quant_method": "fp8", "weight_block_size": ["128", 128]})
    with pytest.raises(ConfigError, match=r"weight_block_size=\['128', 128\] is not supported \(each block size"):
        parse_hf_config(raw, "config.json")
    with pytest.raises(ConfigError, match=r"quantization_config=\['fp8'\] is not supported"):
        parse_hf_config(dict(preset("tiny-deepseek-v3"), quantization_config=["fp8"]), "config.json")


def test_engine_context_is_what_vllm_derives_from_config_json():
    from megatron_rl.model.context_length import engine_context

    # YaRN: max_position_embeddings is the scaled context already (DeepSeek-V3: 4096 x 40)
    assert engine_context(preset("deepseek-v3")) == (163840, "max_position_embeddings")
    assert engine_context(preset("kimi-k2")) == (131072, "max_position_embeddings")
    # another scaling multiplies by its factor; the smallest key wins, model_max_length over all
    llama = preset("tiny-llama")
    assert engine_context(dict(llama, rope_scaling={"rope_type": "linear", "factor": 2.0})) == (
        4096, "max_position_embeddings x rope factor 2")
    assert engine_context(dict(llama, seq_length=512)) == (512, "seq_length")
    assert engine_context(dict(llama, model_max_length=8192)) == (8192, "model_max_length")
    # none of the keys: transformers' default of the family, what the engine loads the config with
    del llama["max_position_embeddings"]
    assert engine_context(llama) == (2048, "family default")
    assert engine_context(dict(llama, architectures=["Qwen3ForCausalLM"])) == (32768, "family default")
