"""`megatron-rl smoke --steps 0` (or a negative count) is refused by name before the runtime or
the model starts; it used to build the model, run no step and report "smoke run done"."""

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
