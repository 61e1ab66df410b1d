"""FP8 recipes and layer-spec choice, decided before any model exists (no GPU needed).

The machine is described by a `Hardware` value, so the whole matrix of recipe x GPU x CUDA x
Transformer Engine version runs here; Megatron-Core's own TransformerConfig checks the fields
we hand it. What only a GPU can show (the recipes actually training) is benchmarks/fp8_moe.py.
"""

from dataclasses import replace

import pytest
import torch

from megatron_rl.config import ModelConfig, load_config

from megatron_rl.errors import ConfigError
from megatron_rl.model import builder, fp8
from megatron_rl.model.fp8 import Hardware, check_fp8, check_recipe, micro_batch_multiple, supported_recipes
from megatron_rl.model.hf_config import load_hf_config, parse_hf_config

CPU = torch.device("cpu")
H100 = Hardware("cuda", "NVIDIA H100 80GB HBM3", (9, 0), "12.9", "2.8.0")
H100_CUDA_12_4 = replace(H100, cuda="12.4")
L40S = Hardware("cuda", "NVIDIA L40S", (8, 9), "12.4", "2.8.0")
A100 = Hardware("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), "12.9", "2.8.0")
B200 = Hardware("cuda", "NVIDIA B200", (10, 0), "12.9", "2.8.0")
RTX_5090 = Hardware("cuda", "NVIDIA GeForce RTX 5090", (12, 0), "12.9", "2.8.0")
NO_TE = replace(H100, te_version=None)


def bf16(recipe: str, **fields) -> ModelConfig:
    return ModelConfig(precision="bf16", fp8_recipe=recipe, **fields)


@pytest.mark.parametrize(
    "hardware, supported",
    [
        (H100, ["delayed", "current", "blockwise"]),
        (H100_CUDA_12_4, ["delayed", "current"]),  # block scaling needs CUDA 12.9
        (L40S, ["delayed", "current"]),
        (A100, []),
        (B200, ["delayed", "current", "blockwise", "mxfp8"]),
        (RTX_5090, ["delayed", "current", "blockwise"]),  # TE: no MXFP8 on 12.0+ yet
        (replace(H100, te_version="2.2.0"), ["delayed", "current"]),  # Float8BlockScaling from TE 2.3
        (replace(H100, te_version="2.3.0.dev0+5fdd7bb"), ["delayed", "current", "blockwise"]),
        (replace(B200, te_version="2.1.0"), ["delayed", "mxfp8"]),  # current scaling from TE 2.2
        (replace(H100, te_version="1.12.0"), ["delayed"]),
        (replace(L40S, cuda="12.0"), []),  # FP8 on Ada needs CUDA 12.1
        (NO_TE, []),
        (Hardware("cpu"), []),
    ],
    ids=["h100", "h100-cuda12.4", "l40s", "a100", "b200", "rtx5090", "te2.2", "te2.3dev", "te2.1", "te1.12",
         "ada-cuda12.0", "no-te", "cpu"],
)
def test_recipe_matrix(hardware, supported):
    assert supported_recipes(hardware) == supported


@pytest.mark.parametrize(
    "recipe, hardware, message",
    [
        ("mxfp8", H100, "model.fp8_recipe='mxfp8' cannot run on NVIDIA H100 80GB HBM3 (compute capability 9.0, "
                        "CUDA 12.9, transformer-engine 2.8.0): it needs compute capability 10.x or 11.x (Blackwell). "
                        "fp8_recipe values this machine supports: delayed, current, blockwise"),
        ("blockwise", L40S, "(compute capability 8.9, CUDA 12.4, transformer-engine 2.8.0): it needs compute "
                            "capability >= 9.0 (Hopper or newer)"),
        ("blockwise", H100_CUDA_12_4, "CUDA 12.4, transformer-engine 2.8.0): it needs torch built with CUDA >= 12.9"),
        ("blockwise", replace(H100, te_version="2.2.0"),
         "transformer-engine 2.2.0): Megatron-Core builds this recipe only with transformer-engine >= 2.3.0.dev0"),
        ("current", replace(H100, te_version="2.1.0"), "transformer-engine 2.1.0): Megatron-Core builds this recipe "
                                                        "only with transformer-engine >= 2.2.0.dev0"),
        ("delayed", A100, "this machine supports no FP8 recipe: remove model.fp8_recipe"),
        ("delayed", NO_TE, "it needs the transformer-engine package"),
        ("blockwise", replace(H100, te_support={"blockwise": (False, "FP8 block scaled GEMM requires Hopper.")}),
         "Transformer Engine reports it unsupported here: FP8 block scaled GEMM requires Hopper"),
    ],
    ids=["mxfp8-on-hopper", "blockwise-on-ada", "blockwise-old-cuda", "blockwise-old-te", "current-old-te",
         "pre-ada", "no-te", "te-verdict"],
)
def test_refusals_name_the_key_the_machine_and_what_to_do(recipe, hardware, message):
    with pytest.raises(ConfigError) as info:
        check_recipe(bf16(recipe), hardware, use_te=True)
    assert message in str(info.value)
    assert f"model.fp8_recipe={recipe!r}" in str(info.value)


def test_te_verdict_allows_what_our_table_allows():
    ok = replace(H100, te_support={"blockwise": (True, ""), "mxfp8": (False, "needs 10.0")})
    check_recipe(bf16("blockwise"), ok, use_te=True)


@pytest.mark.parametrize("hardware, use_te", [(Hardware("cpu"), False), (H100, False)])
def test_fp8_needs_the_te_layer_spec_on_cuda(hardware, use_te):
    with pytest.raises(ConfigError, match="needs Transformer Engine on a CUDA GPU.*local layer spec"):
        check_recipe(bf16("current"), hardware, use_te=use_te)


def test_builder_check_detects_this_cpu_machine():
    hardware = fp8.detect_hardware(CPU)
    assert hardware.device_type == "cpu" and hardware.capability is None
    with pytest.raises(ConfigError, match="this run uses cpu"):
        builder.check_fp8(bf16("blockwise"), CPU, use_te=False)
    builder.check_fp8(ModelConfig(), CPU, use_te=False)  # no FP8: nothing to check


# ------------------------------------------------------------------------------------------------
# Static config checks (ModelConfig.validate): wrong on any machine, refused when loading.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.fp8_recipe=current"], "model.fp8_recipe='current' requires precision: bf16 (got fp32)"),
        (["model.fp8_param=true"], "model.fp8_param=true needs an FP8 recipe"),
        (["model.fp8_bf16_first_layers=1", "model.precision=bf16"], "fp8_bf16_last_layers only apply with fp8_recipe set"),
        (["model.fp8_recipe=delayed", "model.precision=bf16", "model.fp8_bf16_last_layers=1"],
         "model.fp8_recipe=delayed cannot keep layers in BF16"),
        (["model.fp8_recipe=current", "model.precision=bf16", "model.fp8_bf16_first_layers=-1"],
         "model.fp8_bf16_first_layers must be >= 0"),
        (["model.fp8_recipe=tensorwise"], "model.fp8_recipe: 'tensorwise' is not one of 'delayed', 'current'"),
        (["model.moe_grouped_gemm=yes please"], "model.moe_grouped_gemm: "),
    ],
)
def test_static_fp8_settings_are_refused_when_loading(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)


def test_fp8_config_loads():
    config = load_config(None, ["model.precision=bf16", "model.fp8_recipe=blockwise", "model.fp8_param=true",
                                "model.fp8_bf16_first_layers=1", "model.fp8_bf16_last_layers=1",
                                "model.moe_grouped_gemm=false", "model.export_fp8=true"])
    model = config.model
    assert (model.fp8_recipe, model.fp8_param, model.fp8_bf16_layers, model.moe_grouped_gemm, model.export_fp8) == \
        ("blockwise", True, True, False, True)
    defaults = load_config(None, [])
    assert defaults.model.moe_grouped_gemm is None and not defaults.model.export_fp8 and not defaults.model.fp8_param


# ------------------------------------------------------------------------------------------------
# Run-level checks: the recipe against the model's shapes and the parallel layout.
# ------------------------------------------------------------------------------------------------


def run(overrides, preset="tiny-qwen3-moe", **hf):
    config = load_config(None, ["model.precision=bf16", f"model.hf_config={preset}", *overrides])
    raw, where = load_hf_config(preset)
    return config, parse_hf_config(dict(raw, **hf), where)


def test_fp8_param_needs_the_distributed_optimizer():
    config, arch = run(["model.fp8_recipe=current", "model.fp8_param=true", "parallel.distributed_optimizer=false"])
    with pytest.raises(ConfigError, match="model.fp8_param=true requires parallel.distributed_optimizer: true"):
        check_fp8(config, arch, H100, use_te=True, grouped_gemm=True)
    config.parallel.distributed_optimizer = True
    check_fp8(config, arch, H100, use_te=True, grouped_gemm=True)


def test_bf16_layers_must_fit_a_pipeline_stage_and_leave_fp8_layers():
    config, arch = run(["model.fp8_recipe=current", "model.fp8_bf16_first_layers=3", "parallel.pp=2"],
                       num_hidden_layers=4, mlp_only_layers=[])
    with pytest.raises(ConfigError, match="fp8_bf16_first_layers=3 exceeds the layers per pipeline stage \\(2 = 4 layers"):
        check_fp8(config, arch, H100, use_te=True, grouped_gemm=True)
    config.model.fp8_bf16_first_layers, config.model.fp8_bf16_last_layers = 2, 2
    with pytest.raises(ConfigError, match="keeps all 4 layers in BF16"):
        check_fp8(config, arch, H100, use_te=True, grouped_gemm=True)
    config.model.fp8_bf16_last_layers = 1
    check_fp8(config, arch, H100, use_te=True, grouped_gemm=True)


def test_gemm_dimensions_must_be_fp8_aligned():
    config, arch = run(["model.fp8_recipe=current"], moe_intermediate_size=40)
    with pytest.raises(ConfigError, match="multiple of 16, but moe_intermediate_size/etp \\(etp=1\\) = 40"):
        check_fp8(config, arch, H100, use_te=True, grouped_gemm=True)
    config, arch = run(["model.fp8_recipe=mxfp8"], moe_intermediate_size=48)  # 16-aligned, not 32
    with pytest.raises(ConfigError, match="multiple of 32, but moe_intermediate_size/etp"):
        check_fp8(config, arch, B200, use_te=True, grouped_gemm=True)


def test_fp8_grouped_gemm_needs_te_1_11():
    config, arch = run(["model.fp8_recipe=delayed"])
    old_te = replace(H100, te_version="1.10.0")
    with pytest.raises(ConfigError, match="grouped-GEMM experts needs transformer-engine >= 1.11.0.*moe_grouped_gemm: false"):
        check_fp8(config, arch, old_te, use_te=True, grouped_gemm=True)
    check_fp8(config, arch, old_te, use_te=True, grouped_gemm=False)


def test_packed_micro_batches_are_fp8_aligned_per_sequence_parallel_shard():
    assert micro_batch_multiple(ModelConfig(), 1) == 1
    assert micro_batch_multiple(ModelConfig(), 4) == 4
    assert micro_batch_multiple(bf16("blockwise"), 2) == 32
    assert micro_batch_multiple(bf16("mxfp8"), 1) == 32


# ------------------------------------------------------------------------------------------------
# What Megatron-Core receives.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "recipe, megatron, fp8_format",
    [("delayed", "delayed", "hybrid"), ("current", "tensorwise", "hybrid"),
     ("blockwise", "blockwise", "e4m3"), ("mxfp8", "mxfp8", "e4m3")],
)
def test_recipe_names_map_to_megatron(recipe, megatron, fp8_format):
    fields = fp8.transformer_config_fields(bf16(recipe))
    assert fields == dict(fp8=fp8_format, fp8_recipe=megatron, fp8_param=False)


def test_megatron_accepts_our_fp8_fields_and_agrees_on_delayed_scaling():
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = dict(num_layers=4, hidden_size=64, num_attention_heads=4, bf16=True, params_dtype=torch.bfloat16)
    fields = fp8.transformer_config_fields(bf16("current", fp8_param=True, fp8_bf16_first_layers=2))
    tconfig = TransformerConfig(**shape, **fields)
    assert (tconfig.fp8, tconfig.fp8_recipe, tconfig.fp8_param) == ("hybrid", "tensorwise", True)
    assert (tconfig.first_last_layers_bf16, tconfig.num_layers_at_start_in_bf16, tconfig.num_layers_at_end_in_bf16) == \
        (True, 2, 0)
    # Our static check mirrors Megatron-Core's: delayed scaling with BF16 layers is refused there too.
    with pytest.raises(ValueError, match="Delayed scaling does not support first / last layer in BF16"):
        TransformerConfig(**shape, fp8="hybrid", fp8_recipe="delayed", first_last_layers_bf16=True)


def test_transformer_config_carries_fp8_and_grouped_gemm_mocked(monkeypatch):
    """Mocked: a Hopper GPU with TE 2.8 is described, not present, and Megatron's TE version
    check (it imports TE) is stubbed; checks that the builder hands Megatron the right fields."""
    from megatron.core.transformer import transformer_config as megatron_config

    monkeypatch.setattr(megatron_config, "is_te_min_version", lambda *args, **kwargs: True)
    config, arch = run(["model.fp8_recipe=blockwise", "model.fp8_bf16_last_layers=1"])
    tconfig = builder.transformer_config(arch, config, CPU, use_te=True, hardware=H100)
    assert (tconfig.fp8, tconfig.fp8_recipe, tconfig.moe_grouped_gemm) == ("e4m3", "blockwise", True)
    assert (tconfig.first_last_layers_bf16, tconfig.num_layers_at_start_in_bf16, tconfig.num_layers_at_end_in_bf16) == \
        (True, 0, 1)
    with pytest.raises(ConfigError, match="needs compute capability 10.x or 11.x"):
        config.model.fp8_recipe = "mxfp8"
        builder.transformer_config(arch, config, CPU, use_te=True, hardware=H100)


# ------------------------------------------------------------------------------------------------
# Layer spec: Transformer Engine with grouped-GEMM experts on CUDA + TE, local otherwise.
# ------------------------------------------------------------------------------------------------


def test_grouped_gemm_follows_the_layer_spec():
    assert builder.use_grouped_gemm(ModelConfig(), use_te=False) is False
    assert builder.use_grouped_gemm(ModelConfig(), use_te=True) is True
    assert builder.use_grouped_gemm(ModelConfig(moe_grouped_gemm=False), use_te=True) is False
    with pytest.raises(ConfigError, match="model.moe_grouped_gemm=true needs the Transformer Engine layer spec"):
        builder.use_grouped_gemm(ModelConfig(moe_grouped_gemm=True), use_te=False)


def test_permute_fusion_is_asked_for_and_needs_the_te_spec():
    config, arch = run(["model.moe_permute_fusion=true"])
    assert builder.use_permute_fusion(config.model, use_te=True) is True
    assert builder.use_permute_fusion(ModelConfig(), use_te=True) is False  # off unless asked for
    with pytest.raises(ConfigError, match="model.moe_permute_fusion=true needs the Transformer Engine layer spec"):
        builder.transformer_config(arch, config, CPU, use_te=False)  # before Megatron's own assert
    config.model.moe_permute_fusion = False
    assert builder.transformer_config(arch, config, CPU, use_te=False).moe_permute_fusion is False


def test_cpu_builds_local_experts_and_refuses_grouped_gemm():
    config, arch = run([])
    assert builder.use_transformer_engine(config.model, CPU) is False
    assert builder.transformer_config(arch, config, CPU, use_te=False).moe_grouped_gemm is False
    config.model.moe_grouped_gemm = True
    with pytest.raises(ConfigError, match="moe_grouped_gemm=true needs the Transformer Engine layer spec"):
        builder.transformer_config(arch, config, CPU, use_te=False)
    dense, dense_arch = run(["model.moe_grouped_gemm=true"], preset="tiny-qwen3")
    assert builder.transformer_config(dense_arch, dense, CPU, use_te=False).moe_grouped_gemm is False  # no experts


def test_te_spec_with_grouped_gemm_is_chosen_when_present_mocked(monkeypatch):
    """Mocked: TE and CUDA are reported present (neither is here); checks the decision only."""
    monkeypatch.setattr(builder, "transformer_engine_available", lambda: True)
    model = ModelConfig()
    use_te = builder.use_transformer_engine(model, torch.device("cuda", 0))
    assert use_te is True and builder.use_grouped_gemm(model, use_te) is True
    assert builder.use_transformer_engine(ModelConfig(layer_spec="local"), torch.device("cuda", 0)) is False
