"""A `latest` file no run wrote whole (not UTF-8, or megabytes long): every reader of it refuses it
by name or, where a resume picks among the steps anyway, goes by the steps' names. Before, each
read it whole and decoded it as UTF-8: `resolve_checkpoint` (`--ckpt`, `checkpoint.init_from`, a
conversion, a teacher) and `checkpoint.resume=auto` (store.candidates) raised a
UnicodeDecodeError traceback on every rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.checkpoint import store
from megatron_rl.checkpoint.locate import LATEST_BYTES, METADATA, resolve_checkpoint
from megatron_rl.errors import ConfigError


def run_with_latest(run: Path, latest: bytes) -> Path:
    for step in (1, 2):
        directory = run / "checkpoints" / f"step_{step:06d}"
        directory.mkdir(parents=True)
        (directory / METADATA).write_text(json.dumps({"format": "megatron_rl.torch_dist.v1"}))
    (run / "checkpoints" / "latest").write_bytes(latest)
    return run


@pytest.mark.parametrize("latest, named", [
    (b"step_\xff00001\n", "is not UTF-8 text (byte 0xff at offset 5)"),
    (b"step_000001" + b" " * LATEST_BYTES, f"holds more than {LATEST_BYTES} bytes"),
])
def test_a_damaged_latest_is_refused_by_name(tmp_path, latest, named):
    run = run_with_latest(tmp_path / "run", latest)
    with pytest.raises(ConfigError) as refused:
        resolve_checkpoint(run)
    assert str(refused.value).startswith(f"{run}/checkpoints/latest {named}"), refused.value
    assert "pass a step directory" in str(refused.value)


def test_a_resume_over_a_damaged_latest_goes_by_the_steps_names(tmp_path):
    run = run_with_latest(tmp_path / "run", b"\xff\xfe")
    assert [p.name for p in store.candidates(run / "checkpoints")] == ["step_000002", "step_000001"]
