"""rollout.lora_push (docs/lora.md, "Adapter-only push"): merged by default; `adapters` refused by
name, before anything starts, wherever vLLM's native LoRA cannot serve the run here. The push
itself: tests/train/test_lora_rl.py (engine = trainer, bytes) and tests/rollout/test_vllm_lora.py
(families, the silently dropped adapter)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.errors import ConfigError
from megatron_rl.train.preflight import check_layout_and_paths

LORA = ["model.lora.rank=8", "model.lora.alpha=16"]
ADAPTERS = [*LORA, "rollout.lora_push=adapters"]


def test_merged_is_the_default_and_adapters_load_for_attention_targets():
    assert load_config(None, LORA).rollout.lora_push == "merged"
    config = load_config(None, [*ADAPTERS, "model.lora.targets=[qkv,proj]"])
    check_layout_and_paths(config)  # tiny Qwen3-MoE, attention only: accepted
    with pytest.raises(ConfigError, match="'deltas' is not one of 'merged', 'adapters'"):
        load_config(None, [*LORA, "rollout.lora_push=deltas"])


@pytest.mark.parametrize("overrides, match", [
    (["rollout.lora_push=adapters"], "model.lora is not set"),
    ([*ADAPTERS, "rollout.engine=sglang", "rollout.mode=server", "rollout.server_urls=[http://h:1]"],
     "needs vLLM's native LoRA"),
    ([*ADAPTERS, "rollout.mode=server"], "colocated vLLM engine only"),
    ([*ADAPTERS, "model.export_fp8=true", "rollout.dtype=bfloat16"], "FP8 base weights"),
    ([*ADAPTERS, "rl.routing_replay=rollout"], "rl.routing_replay=rollout: the routes recorded"),
])
def test_refused_at_config_load(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


@pytest.mark.parametrize("overrides, match", [
    # null targets on a MoE model include the experts
    ([], r"targets \['experts'\].*CPUUnquantizedExperts does not support LoRA.*GPU expert LoRA is untested"),
    (["model.lora.targets=[qkv,router]"], r"targets \['router'\]"),
    (["model.lora.targets=[proj]", "model.hf_config=tiny-deepseek-v3"], "DeepseekV3ForCausalLM is not a family"),
])
def test_refused_by_preflight(overrides, match):
    config = load_config(None, [*ADAPTERS, *overrides])
    with pytest.raises(ConfigError, match=match):
        check_layout_and_paths(config)


def test_dense_layers_of_a_moe_family_refused(tmp_path):
    """Qwen3-MoE with a dense layer (mlp_only_layers): its MLP shares the experts' module names."""
    from megatron_rl.model import presets

    raw = json.loads((Path(presets.__file__).parent / "tiny-qwen3-moe.json").read_text())
    raw["mlp_only_layers"] = [0]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = load_config(None, [*ADAPTERS, "model.lora.targets=[qkv,fc1]", f"model.hf_config={tmp_path}"])
    with pytest.raises(ConfigError, match=r"targets \['fc1'\] on Qwen3MoeForCausalLM: the dense MLPs"):
        check_layout_and_paths(config)
