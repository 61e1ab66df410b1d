"""The YAML recipes in configs/ load, and their parallel layouts fit the models they name at the
world sizes their comments state (the large ones are not run here: no GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.preflight import check_layout_and_paths

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# Published architecture numbers of the models the large recipes name (their config.json fields).
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "rms_norm_eps": 1e-6,
             "rope_theta": 1000000.0, "tie_word_embeddings": False, "hidden_act": "silu", "vocab_size": 151936,
             "max_position_embeddings": 40960, "head_dim": 128, "norm_topk_prob": True, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "num_experts_per_tok": 8, "num_experts": 128}
MODELS = {
    "qwen3_30b_a3b.yaml": (dict(QWEN3_MOE, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                                num_key_value_heads=4, intermediate_size=6144, moe_intermediate_size=768), 32),
    "qwen3_235b_a22b.yaml": (dict(QWEN3_MOE, hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                                  num_key_value_heads=4, intermediate_size=12288, moe_intermediate_size=1536), 128),
}


def test_tiny_default_recipe_equals_the_built_in_default():
    assert load_config(CONFIGS / "tiny_cpu.yaml") == load_config(None)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_large_recipe_layout_fits_its_model(tmp_path, monkeypatch, name):
    raw, world = MODELS[name]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = load_config(CONFIGS / name, [f"model.hf_config={tmp_path}", "checkpoint.init_from=null",
                                          f"output_dir={tmp_path / 'run'}"])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    check_layout_and_paths(config)
    assert config.rollout.mode == "server"  # colocated TP over the whole world does not fit these
