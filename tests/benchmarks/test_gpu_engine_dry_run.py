"""The GPU engine stage's CPU dry run (benchmarks/gpu_engine.py --dry-run): the code the GPU machine
runs, with vLLM's CPU build as the engine, so the stage does not rot between the rare GPU runs.

The suite runs two of its six checks, the ones that hold the engine to the trainer: `push` (a
colocated fp32 engine fed by the bridge's bucket stream in process) and `server` (the files transport
into the suite's shared tiny vLLM server, tests/conftest.py): after every push the engine's logprobs
of the step's samples equal the trainer's within 1e-4, and without a push they differ. The other
four each start engines or a whole training run of their own (colocated: the push check plus the
GPU-only sleep mode; learns: `megatron-rl train`; r3; fp8: two servers): their dry run is the full
`python benchmarks/gpu_engine.py --dry-run --out DIR`, whose committed result is
benchmarks/results/gpu_engine_cpu.md."""

import json
import subprocess

import pytest

from _support.processes import REPO, child_env, python_command

pytestmark = [pytest.mark.engine, pytest.mark.subprocess]  # vLLM engines, in the stage's check processes

SCRIPT = REPO / "benchmarks" / "gpu_engine.py"
PUSHES = ("push 1 (into dummy weights)", "push 2", "push 3")


def stage(out, *args):
    # children=True: the check processes are forked from the pre-imported Python (vLLM imported).
    result = subprocess.run(python_command(SCRIPT, "--dry-run", "--out", out, *args, preloaded=True, children=True),
                            env=child_env(), capture_output=True, text=True, timeout=600)
    data = json.loads((out / "gpu_engine.json").read_text()) if (out / "gpu_engine.json").exists() else None
    md = (out / "gpu_engine.md").read_text() if (out / "gpu_engine.md").exists() else ""
    return result, data, md


def test_engine_logprobs_equal_the_trainers_after_every_push_in_process_and_by_files(tiny_vllm_server, tmp_path):
    url, _ = tiny_vllm_server
    result, data, md = stage(tmp_path, "--checks", "push,server", "--server-url", url)
    assert data is not None, result.stdout + result.stderr
    assert {name: check["status"] for name, check in data["checks"].items()} == {"push": "passed", "server": "passed"}, md
    assert result.returncode == 0 and data["dry_run"] and data["device"] == "cpu", result.stderr[-3000:]
    for name in ("push", "server"):
        figures = data["checks"][name]["figures"]
        for push in PUSHES:
            found = figures[f"{push}: engine vs trainer logprobs"]
            assert found["max"] <= 1e-4 and found["tokens"] == 8 * 4 * 24, (name, push, found)
            sent = figures[f"{push}: push"]
            assert sent["tensors"] > 0 and sent["bytes"] > 0 and sent["GB/s"] > 0, (name, push, sent)
        # Without a push the engine serves the old weights: the comparison can fail, and does.
        assert figures["after push 1: engine vs trainer logprobs without a push"]["mean"] > 1e-3, figures
        checks = data["checks"][name]["checks"]
        assert len(checks) == 7 and all(c["ok"] for c in checks), checks
        assert f"## {name}: passed" in md
    assert data["checks"]["server"]["figures"]["server"] == url
    assert data["checks"]["server"]["figures"]["transport"].startswith("files")
    assert "| push | engine == trainer logprobs after every push" in md and "| server |" in md


def test_checks_past_the_deadline_are_recorded_and_unknown_checks_refused(tmp_path):
    result, data, md = stage(tmp_path, "--checks", "r3,fp8", "--deadline-s", "0")
    assert result.returncode == 1, result.stderr
    assert {name: check["status"] for name, check in data["checks"].items()} == {"r3": "deadline", "fp8": "deadline"}
    assert "not started: the 0 s deadline had passed" in data["checks"]["fp8"]["error"] and "## r3: deadline" in md

    result, data, _ = stage(tmp_path / "bad", "--checks", "push,sleep")
    assert result.returncode == 2 and data is None
    assert "--checks 'push,sleep': sleep; choose from push,colocated,server,r3,learns,fp8" in result.stderr
