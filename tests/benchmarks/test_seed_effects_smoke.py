"""benchmarks/seed_effects.py --smoke for the length effect: its warm start and arms (GRPO and
Dr. GRPO) run (2 RL steps of a few samples, one seed) through the real trainer, and the report
(markdown section, JSON, plot) is written. Only the pipeline is checked, never the effect: the full
benchmark (about 2 hours) is not part of the suite, and the other effects run the same pipeline
with other settings (each would add about a minute to a suite near its time limit)."""

import json
import subprocess

import pytest

from _support.processes import REPO, child_env, python_command

EFFECTS = ("length",)


@pytest.mark.engine
def test_the_length_effect_runs_and_reports(tmp_path):
    env = child_env(OMP_NUM_THREADS="2")
    results = tmp_path / "results"
    for effect in EFFECTS:
        result = subprocess.run(python_command(REPO / "benchmarks/seed_effects.py", effect, "--smoke",
                                               "--work", tmp_path / "work", "--results", results, preloaded=True,
                                               children=True),
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
    markdown = (results / "seed_effects.md").read_text()
    for effect in EFFECTS:
        assert f"## {effect}:" in markdown
    assert "Smoke run" in markdown
