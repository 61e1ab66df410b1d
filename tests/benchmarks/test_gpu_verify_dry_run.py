"""The GPU verification kit's CPU dry run (`scripts/gpu_kit/run.sh --dry-run`): stages a-c of
benchmarks/gpu_verify.py with the code the GPU runs, the CPU standing in for the device under
test, so the kit does not rot between the rare GPU runs. The CPU against itself must agree bit
for bit (one thread, the same code), well inside the tolerances stated for the GPU."""

import json
import subprocess

import pytest

from _support.processes import REPO, child_env, forked_python

pytestmark = pytest.mark.subprocess  # runs the kit's script and its stage processes

RUN = REPO / "scripts" / "gpu_kit" / "run.sh"


def dry_run(out, *extra):
    result = subprocess.run(["bash", str(RUN), "--dry-run", str(out), *extra], env=child_env(PYTHON=forked_python()),
                            capture_output=True, text=True, timeout=600)
    return result, json.loads((out / "gpu_verify.json").read_text()), (out / "gpu_verify.md").read_text()


def checks_of(stage: dict) -> dict:
    return {c["check"]: c for c in stage["checks"]}


def test_dry_run_passes_stages_a_to_c_within_their_tolerances(tmp_path):
    result, data, md = dry_run(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert data["dry_run"] and [(s, r["status"]) for s, r in data["stages"].items()] == \
        [("a", "passed"), ("b", "passed"), ("c", "passed")], md

    step = checks_of(data["stages"]["b"])
    for precision, tolerance in (("fp32", 1e-4), ("bf16", 0.1)):
        logprobs = step[f"{precision}: logprobs max |diff|"]
        assert logprobs["tolerance"] == tolerance and logprobs["value"] == 0 and logprobs["ok"]
        for name in ("loss rel. diff", "grad norm rel. diff", "updated weights, rel. L2 diff of the update"):
            assert step[f"{precision}: {name}"]["value"] == 0
        assert step[f"{precision}: both steps updated"]["ok"]
        assert data["stages"]["b"]["figures"][f"{precision} bit-identical weights after the step"] is True

    export = checks_of(data["stages"]["c"])
    for model in ("tiny-qwen3-moe", "qwen3-30b-a3b shapes"):
        assert export[f"{model}: tensors not bit-identical (values and scales)"]["value"] == 0
        assert export[f"{model}: same tensors in the same order"]["ok"]
        assert 0 < export[f"{model}: dequantization error vs block amax"]["value"] <= 2 ** -4

    for stage in "abc":
        assert f"## {stage}. " in md and data["stages"][stage]["seconds"] > 0
    assert "| b | tiny MoE policy step" in md and "| passed |" in md


def test_a_failed_stage_is_recorded_and_the_next_stage_still_runs(tmp_path):
    # Stage b gets one millisecond: it is killed (with its step processes) and recorded; a runs after it.
    result, data, md = dry_run(tmp_path, "--stages", "ba", "--timeout", "b=0.001")
    assert result.returncode == 1
    assert list(data["stages"]) == ["b", "a"], md
    assert data["stages"]["b"]["status"] == "timed out"
    assert "killed after its limit of 0.001 s" in data["stages"]["b"]["error"]
    assert data["stages"]["a"]["status"] == "passed" and data["stages"]["a"]["figures"]["torch"]
    assert "## b. tiny MoE policy step: device vs CPU (fp32 TF32 off, bf16): timed out" in md
    assert "## a. versions, GPU: passed" in md
