"""What the `megatron-rl eval` refusal modules stand in for a checkpoint, and how they run the CLI
expecting one refusal line: the cases stop before the engine stage, so only the files a checkpoint
is told apart by are written, never weights."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from megatron_rl import cli

PRESETS = Path(cli.__file__).parent / "model" / "presets"


def stand_in_hf(tmp_path: Path, export: str | None = None) -> Path:
    """A stand-in Hugging Face directory (the tiny model's config.json and an empty weights file),
    with `export` as its megatron_rl_export.json."""
    directory = tmp_path / "hf"
    directory.mkdir()
    shutil.copy(PRESETS / "tiny-qwen3-moe.json", directory / "config.json")
    (directory / "model.safetensors").write_bytes(b"")
    if export is not None:
        (directory / "megatron_rl_export.json").write_text(export)
    return directory


def stand_in_run(tmp_path: Path, state: str) -> Path:
    """A stand-in run directory whose one training checkpoint's trainer_state.json is `state`."""
    step = tmp_path / "run" / "checkpoints" / "step_000001"
    (step / "hf_config").mkdir(parents=True)
    shutil.copy(PRESETS / "tiny-qwen3-moe.json", step / "hf_config" / "config.json")
    metadata = {"format": "megatron_rl.torch_dist.v1", "weights_dir": "weights"}
    (step / "megatron_rl.json").write_text(json.dumps(metadata))
    (step / "trainer_state.json").write_text(state)
    (step.parent / "latest").write_text("step_000001")
    return tmp_path / "run"


def refused(capsys, *argv: str, within: float = 2.0) -> str:
    """`megatron-rl eval ARGV`'s one-line refusal (exit status 2), which must come within `within` s."""
    tick = time.perf_counter()
    status = cli.main(["eval", *argv])
    elapsed = time.perf_counter() - tick
    err = capsys.readouterr().err
    assert status == 2, err
    assert elapsed < within, f"refused after {elapsed:.2f} s"
    assert err.startswith("megatron-rl: configuration error: ") and err.count("\n") == 1, err
    return err
