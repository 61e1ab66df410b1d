"""Where vLLM keeps enable_return_routed_experts (rollout/worker/route_capture.vllm_returns_routes):
0.32 in aux_output_config, 0.26 (the last release pinning torch 2.11) in model_config. Fake config
objects of each shape: the real 0.26 engine runs only on a GPU (benchmarks/gpu_engine.py, check r3)."""

from types import SimpleNamespace

from megatron_rl.rollout.worker.route_capture import vllm_returns_routes


def fake_config(section: str | None, on: bool = True) -> SimpleNamespace:
    sections = {"aux_output_config": SimpleNamespace(), "model_config": SimpleNamespace(enforce_eager=False)}
    if section is None:  # 0.26's shape, the flag off
        sections.pop("aux_output_config")
        sections["model_config"].enable_return_routed_experts = False
    else:
        setattr(sections[section], "enable_return_routed_experts", on)
    return SimpleNamespace(**sections)


def test_fake_configs_of_both_vllm_versions_are_read_where_they_keep_the_flag():
    assert vllm_returns_routes(fake_config("aux_output_config"))  # vLLM 0.32
    assert vllm_returns_routes(fake_config("model_config"))  # vLLM 0.26
    assert not vllm_returns_routes(fake_config("aux_output_config", on=False))
    assert not vllm_returns_routes(fake_config(None))
    assert not vllm_returns_routes(SimpleNamespace())
