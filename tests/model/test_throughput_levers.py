"""The MoE throughput levers (config/model.py, model/throughput_levers.py): each refused by name
where it cannot apply, before the model exists, and mapped onto the TransformerConfig fields
Megatron-Core reads. The machine is a `Hardware` description, so the GPU cases run here; whether a
lever is faster is a GPU measurement, not a test."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.config import load_config
from megatron_rl.config.model import LEVERS_OFF
from megatron_rl.errors import ConfigError
from megatron_rl.model import builder, throughput_levers
from megatron_rl.model.fp8 import Hardware
from megatron_rl.model.hf_config import load_hf_config, parse_hf_config

CPU = torch.device("cpu")
H100 = Hardware("cuda", "NVIDIA H100 80GB HBM3", (9, 0), "12.9", "2.11.0", wgrad_accumulation_kernel=True)
B200 = replace(H100, name="NVIDIA B200", capability=(10, 0))


def run(overrides, preset="tiny-qwen3-moe"):
    config = load_config(None, ["model.precision=bf16", f"model.hf_config={preset}", *overrides])
    raw, where = load_hf_config(preset)
    return config, parse_hf_config(raw, where)


def refusal(overrides, preset="tiny-qwen3-moe", hardware=H100, use_te=True) -> str:
    config, arch = run(overrides, preset)
    with pytest.raises(ConfigError) as info:
        builder.transformer_config(arch, config, CPU, use_te=use_te, hardware=hardware)
    return str(info.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.moe_router_padding_for_fp8=true"], "model.moe_router_padding_for_fp8=true pads expert token counts "
         "to the FP8 alignment: it needs fp8_recipe"),
        (["model.moe_router_padding_for_fp8=true", "model.fp8_recipe=blockwise", "model.moe_token_dispatcher=allgather"],
         "model.moe_router_padding_for_fp8=true needs moe_token_dispatcher: alltoall"),
        (["model.moe_grouped_gemm_backend=cutlass", "model.fp8_recipe=blockwise"],
         "model.moe_grouped_gemm_backend=cutlass with fp8_recipe='blockwise'"),
        (["model.moe_grouped_gemm_backend=cutlas"], "model.moe_grouped_gemm_backend: 'cutlas' is not one of"),
        (["model.lora={}", "model.layer_spec=local", "model.gradient_accumulation_fusion=true"],
         "model.gradient_accumulation_fusion with lora"),
        (["model.lora={}", "model.layer_spec=local", "model.moe_permute_fusion=true"],
         "model.moe_permute_fusion with lora"),
    ],
)
def test_static_refusals_name_the_key_and_what_to_do(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model.precision=bf16", *overrides])
    assert message in str(info.value)


@pytest.mark.parametrize("lever", ["model.gradient_accumulation_fusion=true", "model.moe_grouped_gemm_backend=cutlass",
                                   "model.moe_router_fusion=true"])
def test_te_levers_are_refused_on_cpu_and_with_the_local_spec(lever):
    key = lever.split("=")[0]
    assert f"{key}=" in refusal([lever], hardware=Hardware("cpu"), use_te=False)
    assert "this run builds CPU: leave it at its default" in refusal([lever], hardware=Hardware("cpu"), use_te=False)
    assert "this run builds the local layer spec" in refusal([lever], use_te=False)


def test_gradient_accumulation_fusion_needs_apex_wgrad_kernel():
    no_apex = replace(H100, wgrad_accumulation_kernel=False)
    message = refusal(["model.gradient_accumulation_fusion=true"], hardware=no_apex)
    assert "model.gradient_accumulation_fusion=true needs APEX's fused_weight_gradient_mlp_cuda" in message


def test_cutlass_backend_needs_hopper_grouped_experts_and_128_aligned_k():
    assert "runs only on compute capability 9.0" in refusal(["model.moe_grouped_gemm_backend=cutlass"], hardware=B200)
    assert "no grouped-GEMM experts" in refusal(["model.moe_grouped_gemm_backend=cutlass"], preset="tiny-qwen3")
    assert "no grouped-GEMM experts" in refusal(["model.moe_grouped_gemm_backend=cutlass",
                                                  "model.moe_grouped_gemm=false"])
    assert "but hidden_size = 64" in refusal(["model.moe_grouped_gemm_backend=cutlass"])  # the tiny model


# One update per rollout: no old-logprob pass (the default, 2, has one).
FUSION = ["model.moe_router_fusion=true", "rl.updates_per_rollout=1"]


def test_router_fusion_refused_where_it_skips_the_replay_hook():
    assert "needs transformer-engine >= 2.7.0.dev0 (installed: 2.6.0)" in refusal(
        FUSION, hardware=replace(H100, te_version="2.6.0"))
    assert "with rl.routing_replay=training" in refusal([*FUSION, "rl.routing_replay=training"])
    assert "with rl.updates_per_rollout=2" in refusal([*FUSION, "rl.updates_per_rollout=2"])
    assert "with an off-policy mask" in refusal([*FUSION, "rl.off_policy.method=mis"])
    assert "routes by expert groups" in refusal(FUSION, preset="tiny-deepseek-v3")
    assert "this model is dense" in refusal(FUSION, preset="tiny-qwen3")


def test_router_padding_needs_an_moe_model():
    assert "model.moe_router_padding_for_fp8=true applies to MoE routers" in refusal(
        ["model.moe_router_padding_for_fp8=true", "model.fp8_recipe=blockwise"], preset="tiny-qwen3")


def test_builder_maps_the_levers_onto_transformer_config_mocked(monkeypatch):
    """Mocked: a Hopper GPU with TE 2.11 is described, not present, and Megatron's TE version check
    is stubbed; the TransformerConfig is built (no model) and read back."""
    from megatron.core.transformer import transformer_config as megatron_config

    monkeypatch.setattr(megatron_config, "is_te_min_version", lambda *args, **kwargs: True)
    config, arch = run([])
    default = builder.transformer_config(arch, config, CPU, use_te=True, hardware=H100)
    assert (default.gradient_accumulation_fusion, default.moe_router_fusion, default.moe_router_padding_for_fp8,
            default.cuda_graph_impl) == (False, False, False, "none")
    config, arch = run(["model.gradient_accumulation_fusion=true", *FUSION, "model.moe_router_padding_for_fp8=true",
                        "model.fp8_recipe=blockwise"])
    tconfig = builder.transformer_config(arch, config, CPU, use_te=True, hardware=H100)
    assert (tconfig.gradient_accumulation_fusion, tconfig.moe_router_fusion, tconfig.moe_router_padding_for_fp8,
            tconfig.moe_router_padding_for_quantization, tconfig.cuda_graph_impl) == (True, True, True, True, "none")
    config, arch = run(["model.moe_grouped_gemm_backend=cutlass"], preset="qwen3-30b-a3b")
    assert builder.transformer_config(arch, config, CPU, use_te=True, hardware=H100).moe_grouped_gemm is True


def test_grouped_gemm_backend_is_set_in_process_from_the_key():
    config, _ = run(["model.moe_grouped_gemm_backend=cutlass"])
    environ = {}
    throughput_levers.select_grouped_gemm_backend(config.model, grouped_gemm=True, environ=environ)
    assert environ == {"NVTE_USE_CUTLASS_GROUPED_GEMM": "1", "NVTE_CUTLASS_GROUPED_GEMM_WARN_FALLBACK": "1"}
    config, _ = run([])
    inherited = {"NVTE_USE_CUTLASS_GROUPED_GEMM": "1"}  # the key decides, not the shell
    throughput_levers.select_grouped_gemm_backend(config.model, grouped_gemm=True, environ=inherited)
    assert inherited == {"NVTE_USE_CUTLASS_GROUPED_GEMM": "0"}
    untouched = {}
    throughput_levers.select_grouped_gemm_backend(config.model, grouped_gemm=False, environ=untouched)
    assert untouched == {}


def test_build_model_sets_the_backend_before_the_model_exists_mocked(monkeypatch):
    """Mocked: TE is reported present and the TransformerConfig is a stand-in (no GPU here); checks
    the order only: the backend is in the environment before the first module is built."""
    events = []
    monkeypatch.setattr(builder, "use_transformer_engine", lambda model, device: True)
    monkeypatch.setattr(builder, "transformer_config", lambda *args: SimpleNamespace(moe_grouped_gemm=True))
    monkeypatch.setattr(throughput_levers, "select_grouped_gemm_backend",
                        lambda model, grouped_gemm: events.append(("backend", grouped_gemm)))

    def build_gpt_model(*args):
        events.append(("model",))
        raise StopIteration  # nothing past the build matters here

    monkeypatch.setattr(builder, "build_gpt_model", build_gpt_model)
    config, _ = run(["model.moe_grouped_gemm_backend=cutlass"])
    with pytest.raises(StopIteration):
        builder.build_model(config, CPU)
    assert events == [("backend", True), ("model",)]


def test_planner_probe_builds_with_the_levers_off():
    from megatron_rl.plan.meta_model import _without_fp8

    config, _ = run(["model.gradient_accumulation_fusion=true", "model.moe_permute_fusion=true",
                     "model.moe_router_fusion=true"])
    probe = _without_fp8(config).model
    assert {name: getattr(probe, name) for name in LEVERS_OFF} == LEVERS_OFF
    assert throughput_levers.levers_on(config.model) == ["gradient_accumulation_fusion", "moe_router_fusion",
                                                          "moe_permute_fusion"]


def test_levers_off_is_read_only():
    """LEVERS_OFF is spread into every planner probe's config: a write would change them all."""
    with pytest.raises(TypeError):
        LEVERS_OFF["moe_router_fusion"] = True
    assert LEVERS_OFF["moe_router_fusion"] is False
