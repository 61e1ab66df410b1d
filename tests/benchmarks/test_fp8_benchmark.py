"""benchmarks/fp8_moe.py without a GPU: it must say it measured nothing, and its FLOP count is
checked against the parameters of the same model built by transformers."""

import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from _support.processes import REPO

pytestmark = pytest.mark.subprocess  # runs a child process (pyproject's marks; scripts/test.sh --quick)

SCRIPT = REPO / "benchmarks" / "fp8_moe.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("fp8_moe_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_cuda_and_te_it_exits_with_a_clear_message():
    result = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert result.returncode == 2
    assert "needs a CUDA GPU with the transformer-engine package" in result.stderr
    assert "Nothing was measured" in result.stderr and "Traceback" not in result.stderr


def small(**changes):
    args = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, experts=8, top_k=2, expert_width=48, vocab=300)
    return SimpleNamespace(**{**args, **changes})


def test_active_parameters_match_the_transformers_model(bench):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = bench.model_config(small())
    with torch.device("meta"):
        fields = {k: v for k, v in hf.items() if k != "model_type"}
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **fields))
    active = 0
    for name, param in model.named_parameters():
        if ".experts." in name:
            active += param.numel() * hf["num_experts_per_tok"] // hf["num_experts"]
        elif name.endswith(("_proj.weight", "mlp.gate.weight")) or name == "lm_head.weight":
            active += param.numel()
    assert bench.active_params_per_token(hf) == active


def test_flops_count_causal_attention_per_sample(bench):
    hf = bench.model_config(small())
    dense = 6 * bench.active_params_per_token(hf) * 30
    attention = 6 * hf["num_hidden_layers"] * hf["num_attention_heads"] * hf["head_dim"] * (10**2 + 20**2)
    assert bench.step_flops(hf, [10, 20]) == dense + attention


def test_synthetic_data_is_fixed_and_fills_each_step(bench):
    steps = bench.synthetic_steps(vocab=300, steps=3, tokens_per_step=1000, min_len=20, max_len=200)
    assert steps == bench.synthetic_steps(vocab=300, steps=3, tokens_per_step=1000, min_len=20, max_len=200)
    for samples in steps:
        assert sum(map(len, samples)) == 1000
        assert all(2 <= len(s) <= 200 for s in samples) and all(0 <= t < 300 for s in samples for t in s)


def test_relative_loss_difference(bench):
    assert bench.relative_loss_diff([2.2, 1.1], [2.0, 1.0]) == pytest.approx(0.1)
    assert bench.relative_loss_diff([9.0, 2.2, 1.1], [3.0, 2.0, 1.0], last=2) == pytest.approx(0.1)
    assert bench.peak_tflops("NVIDIA H100 80GB HBM3", None) == 989.0
    assert bench.peak_tflops("NVIDIA H100 PCIe", None) == 756.0
    assert bench.peak_tflops("NVIDIA L40S", None) is None and bench.peak_tflops("NVIDIA L40S", 362.0) == 362.0
