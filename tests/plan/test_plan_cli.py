"""`megatron-rl plan` end to end: the published models' configs ship with the package (nothing is
downloaded), every layout it lists passes preflight's check, a layout that cannot fit names its
largest consumer and the smallest change that fits, and a model of an unknown family is refused
by name."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from _support.processes import REPO, child_env, cli_command

pytestmark = pytest.mark.subprocess  # runs a child process (pyproject's marks; scripts/test.sh --quick)


def plan(*args: str) -> subprocess.CompletedProcess:
    env = child_env(OMP_NUM_THREADS="2")
    return subprocess.run(cli_command("plan", *args, preloaded=True), capture_output=True, text=True, timeout=300, env=env, cwd=REPO)


def test_deepseek_v3_recipe_plans_from_its_shipped_architecture():
    start = time.monotonic()
    result = plan("--config", "configs/deepseek_v3.yaml", "--gpus", "256", "--gpu-memory", "141GB",
                  "model.recompute=full")
    seconds = time.monotonic() - start
    print(f"plan deepseek_v3 256 GPUs: {seconds:.1f} s")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "DeepseekV3ForCausalLM from preset deepseek-v3: 61 layers" in out
    assert "The config's layout (tp8 pp4 ep64 etp1 (last stage 13)): fits" in out
    assert "megatron-rl launch slurm --config CONFIG --nodes 32 --gpus-per-node 8 parallel.tp=" in out


def test_json_lists_only_layouts_preflight_accepts_and_the_numbers_add_up():
    result = plan("--config", "configs/qwen3_30b_a3b.yaml", "--gpus", "32", "--rollout-gpus", "16", "--json",
                  "model.architecture=qwen3-30b-a3b", "model.hf_config=qwen3-30b-a3b", "parallel.tp=2")
    assert result.returncode == 0, result.stdout + result.stderr
    plan_json = json.loads(result.stdout)
    layouts = plan_json["layouts"]
    assert layouts and plan_json["config_layout"]["tp"] == 2
    seen = set()
    for layout in layouts:
        tp, pp, ep, etp, cp = (layout[k] for k in ("tp", "pp", "ep", "etp", "cp"))
        assert 32 % (tp * pp * cp) == 0 and 32 % (etp * ep * pp) == 0 and 128 % ep == 0 and 4 % tp == 0
        assert layout["dp"] == 32 // (tp * pp * cp)
        seen.add((tp, pp, ep, etp))
        # the trainer bytes of the fullest stage and what is left add up to the GPU
        fullest = max(layout["stages"], key=lambda s: sum(s[k] for k in ("params_bytes", "grads_bytes",
                      "main_params_bytes", "moments_bytes", "activations_bytes")))
        used = sum(fullest[k] for k in ("params_bytes", "grads_bytes", "main_params_bytes", "moments_bytes",
                                        "activations_bytes"))
        assert used + layout["left_bytes"] == layout["trainer_budget_bytes"] == 80 * 2**30
        assert sum(s["layers"] for s in layout["stages"]) == 48
    assert len(seen) == len(layouts)  # no layout twice
    fits = [layout["fits"] for layout in layouts]
    assert fits == sorted(fits, reverse=True)  # the layouts that fit come first


def test_a_layout_that_cannot_fit_names_its_largest_consumer_and_the_smallest_fix():
    result = plan("--config", "configs/qwen3_30b_a3b.yaml", "--gpus", "32", "--rollout-gpus", "16",
                  "--hf-config", "qwen3-30b-a3b", "micro_batch_tokens=32768", "parallel.tp=2")
    out = result.stdout
    assert "The config's layout (tp2 pp1 ep8 etp1): does NOT fit" in out, out + result.stderr
    assert "the largest consumer is activations" in out
    assert "Smallest change that fits: model.recompute=full." in out


def test_unknown_family_and_bad_cluster_are_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"], "model_type": "foo"}))
    result = plan("--hf-config", str(tmp_path), "--gpus", "8", "device=cuda")
    assert result.returncode == 2 and "FooForCausalLM" in result.stderr, result.stderr
    result = plan("--config", "configs/qwen3_30b_a3b.yaml", "--hf-config", "qwen3-30b-a3b", "--gpus", "12")
    assert result.returncode == 2 and "--gpus 12 is not a whole number of nodes" in result.stderr, result.stderr
    result = plan("--config", "configs/qwen3_30b_a3b.yaml", "--hf-config", "qwen3-30b-a3b", "--gpus", "32",
                  "--gpu-memory", "lots")
    assert result.returncode == 2 and "--gpu-memory 'lots'" in result.stderr, result.stderr
