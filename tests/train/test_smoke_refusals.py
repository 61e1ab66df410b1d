"""`megatron-rl smoke` refuses by name, before the runtime or the model starts, `--steps 0` (or a
negative count: it built the model, ran no step and reported "smoke run done") and an output
directory that holds a training run (it appended its rows to the run's metrics.jsonl)."""

from __future__ import annotations

import pytest

from megatron_rl.config import load_config
from megatron_rl.errors import ConfigError
from megatron_rl.train import smoke


@pytest.mark.parametrize("steps", [0, -1])
def test_smoke_refuses_fewer_than_one_step_before_starting(monkeypatch, tmp_path, steps):
    def started(config):
        raise AssertionError("the runtime started")

    monkeypatch.setattr(smoke, "start_runtime", started)
    config = load_config(None, [f"output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=rf"--steps must be >= 1 \(forward/backward steps of the smoke run\), "
                                          rf"got {steps}"):
        smoke.run_smoke(config, steps=steps)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("held", ["run.json", "run_state.json", "run.lock", "checkpoints"])
def test_smoke_refuses_a_training_runs_directory(monkeypatch, tmp_path, held):
    """`smoke --output-dir runs/default` appended its step 1..N rows to the run's metrics.jsonl."""
    monkeypatch.setattr(smoke, "start_runtime", lambda config: pytest.fail("the runtime started"))
    (tmp_path / held).mkdir() if held == "checkpoints" else (tmp_path / held).write_text("{}")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match=rf"output_dir {tmp_path} is a training run's directory \(it holds {held}\)"):
        smoke.run_smoke(load_config(None, [f"output_dir={tmp_path}"]), steps=2)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'
