"""The policy on one CPU process: packing isolation, architecture fidelity, the CPU layer, the CLI.

Each check runs in a fresh subprocess (policy_worker.py), as a real single-rank gloo job.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from _support.processes import REPO, child_env, cli_command, python_command
from megatron_rl.model.hf_config import load_hf_config

pytestmark = pytest.mark.subprocess  # runs a child process (pyproject's marks; scripts/test.sh --quick)

WORKER = Path(__file__).with_name("policy_worker.py")


def run_worker(mode: str, hf_config: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{mode}.json"
    env = child_env(OMP_NUM_THREADS="2")
    result = subprocess.run(python_command(WORKER, mode, hf_config, out, preloaded=True),
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-5000:]
    return json.loads(out.read_text())


def family_config(tmp_path: Path, architecture: str) -> str:
    """A tiny config.json for a family, written the way transformers writes it."""
    raw, _ = load_hf_config("tiny-llama")
    extra = {
        "Qwen2ForCausalLM": {"model_type": "qwen2"},
        "MixtralForCausalLM": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    }[architecture]
    raw = dict(raw, architectures=[architecture], **extra)
    path = tmp_path / architecture
    path.mkdir()
    (path / "config.json").write_text(json.dumps(raw))
    return str(path)


# DeepSeek-V3: multi-latent attention (value heads narrower than query/key heads, its own RoPE
# path) on packed rows. GLM-4.5's attention is the standard one the others exercise.
@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-llama", "tiny-deepseek-v3"])
def test_packed_samples_do_not_see_each_other(tmp_path, preset):
    result = run_worker("packing", preset, tmp_path)
    assert result["response_lengths"] == [13, 3, 23, 8]
    assert result["logprob_diff"] <= 1e-5, result
    assert result["entropy_diff"] <= 1e-5, result
    assert result["cpu_layer_active"] and result["current_device"] == "cpu"


@pytest.mark.parametrize("family", ["tiny-qwen3-moe", "tiny-qwen3", "tiny-llama", "Qwen2ForCausalLM", "MixtralForCausalLM",
                                    "tiny-deepseek-v3", "tiny-glm4-moe"])
def test_parameter_count_matches_transformers(tmp_path, family):
    hf_config = family if family.startswith("tiny") else family_config(tmp_path, family)
    result = run_worker("params", hf_config, tmp_path)
    assert result["megatron_without_padding"] == result["hf"], result


def test_cli_smoke_run(tmp_path):
    env = child_env(OMP_NUM_THREADS="2")
    result = subprocess.run(
        cli_command("smoke", "--steps", "2", "--output-dir", str(tmp_path / "run"), "optimizer.lr=1e-3", preloaded=True),
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    assert "step 2/2" in result.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert records[1]["train/loss"] < records[0]["train/loss"]  # lr 1e-3 on the same batch


def test_cli_reports_config_errors_before_work(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(cli_command("train", "parallel.tp=3"),
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "configuration error" in result.stderr


def test_non_finite_gradient_skips_the_update_and_overflowing_weights_are_reported(tmp_path):
    """A NaN gradient (on an MoE model: expert buffers too) must leave every weight as it was
    and report a skipped update, where Megatron's own check raised ("found NaN in local grad
    norm") and its clipping would have let Adam write NaN; an update that overflows the weights
    must be reported so that the trainer neither saves nor pushes them."""
    result = run_worker("nonfinite", "tiny-qwen3-moe", tmp_path)
    assert result["nan_step"] == {"updated": False, "grad_norm": "nan", "weights_finite": True}, result
    assert result["nan_step_changed_weights"] == 0, result
    assert result["good_step"]["updated"] and result["good_step"]["weights_finite"], result
    assert result["good_step_changed_weights"] > 1000, result  # the guard does not freeze good updates
    assert result["blown_step"] == {"updated": True, "weights_finite": False}, result
    assert result["blown_max_weight"] > 1e19, result
    # The weight norm the update guard compares (train/update_guard.py): that of the weights,
    # before any update and after each completed one; none for a skipped one, inf for blown weights.
    norms = result["norms"]
    assert norms["start"] == pytest.approx(norms["start_of_weights"], rel=1e-6), norms
    assert norms["good_step"] == pytest.approx(norms["good_step_of_weights"], rel=1e-6), norms
    assert norms["good_step"] != norms["start"] and norms["nan_step"] == "nan" and norms["blown_step"] == "inf", norms
    assert result["good_step_lr"] == pytest.approx(5e-4), result  # optimizer.lr: the rate the update ran at
