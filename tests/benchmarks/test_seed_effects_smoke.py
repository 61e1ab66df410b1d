"""benchmarks/seed_effects.py --smoke for two effects: their warm starts and arms run (2 RL steps of
a few samples, one seed, the first and the last arm) through the real trainer, and the report
(markdown section, JSON, plot) is written. Only the pipeline is checked, never the effect: the full
benchmark (about 2 hours) is not part of the suite. The two are the effects whose runs differ most
(the reasoning task with two losses; a model of its own with routing replay); the other three reuse
their paths with other settings, and each costs a minute of suite time."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EFFECTS = ("length", "moe")


@pytest.mark.engine
def test_every_effect_runs_and_reports(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="2")
    results = tmp_path / "results"
    for effect in EFFECTS:
        result = subprocess.run([sys.executable, str(REPO / "benchmarks/seed_effects.py"), effect, "--smoke",
                                 "--work", str(tmp_path / "work"), "--results", str(results)],
                                capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
        assert result.returncode == 0, f"{effect}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        assert (results / f"seed_effects_{effect}.png").stat().st_size > 10_000

    stored = json.loads((results / "seed_effects.json").read_text())
    assert set(stored) == set(EFFECTS)
    for effect in EFFECTS:
        runs = stored[effect]["runs"]
        assert len(runs) == 2, (effect, list(runs))  # the first and the last arm, one seed each
        for values in runs.values():
            (run,) = values.values()
            assert run[stored[effect]["primary"]] == run[stored[effect]["primary"]], effect  # not NaN
    # the routing effect ran its own model (16 experts): its warm start says so
    moe_config = json.loads((tmp_path / "work/model-moe/config.json").read_text())
    assert moe_config["num_experts"] == 16 and moe_config["num_hidden_layers"] == 4
    markdown = (results / "seed_effects.md").read_text()
    for effect in EFFECTS:
        assert f"## {effect}:" in markdown
    assert "Smoke run" in markdown
