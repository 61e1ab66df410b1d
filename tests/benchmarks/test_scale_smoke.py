"""benchmarks/scale.py --sizes small must keep working: a few-MB synthetic Qwen3-MoE checkpoint is
written, copied, imported and exported, converted to torch_dist and back at TP1 and at EP2 (two
gloo ranks), each round trip compared bit for bit with the original, and the report (markdown,
JSON, plot) is written. Only the pipeline is checked, never the timings or the memory: the
benchmark's step processes are forked from the pre-imported interpreter (children=True; 18 s
instead of 66 s of fresh imports), so the figures it records are those of the stand-in processes
it watches, and only recorded. The work directory must be gone afterwards."""

import json
import subprocess

import pytest

from _support.processes import REPO, child_env, python_command

pytestmark = pytest.mark.multiprocess


def test_small_run_round_trips_bit_exact_and_reports(tmp_path):
    env = child_env(OMP_NUM_THREADS="2")
    work, out = tmp_path / "work", tmp_path / "results" / "scale"
    result = subprocess.run(python_command(REPO / "benchmarks" / "scale.py", "--sizes", "small",
                                           "--work", work, "--out", out, "--no-drop-caches", preloaded=True,
                                           children=True),
                            capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    assert "tp1 bit-exact" in result.stdout and "ep2 bit-exact" in result.stdout, result.stdout
    stored = json.loads(out.with_suffix(".json").read_text())
    (size,) = stored["sizes"]
    assert all(trip["bit_exact"] for trip in size["round_trip"].values())
    for step in ("copy", "import", "export", "tp1_to_torch_dist", "tp1_to_hf", "ep2_to_torch_dist", "ep2_to_hf"):
        assert size["steps"][step]["wall_s"] > 0 and size["steps"][step]["peak_anon"] > 0, step
    assert "| small | TP1 HF -> torch_dist |" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert not any(work.iterdir()), "the generated checkpoints were left on disk"
