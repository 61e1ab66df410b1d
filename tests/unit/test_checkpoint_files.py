"""Checkpoint directory handling without processes: completeness checks, the fallback to the
previous checkpoint, and the metrics file cut back to the checkpoint on resume."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_rl.checkpoint import LATEST, MANIFEST, STATE, _inventory, _prune, find_resumable, verify
from megatron_rl.logging import WALL_CLOCK, MetricsLog, read_metrics, truncate_metrics


def fake_checkpoint(root: Path, step: int) -> Path:
    path = root / f"step_{step:06d}"
    (path / "weights").mkdir(parents=True)
    (path / "weights" / "shard.distcp").write_bytes(b"x" * (100 + step))
    (path / STATE).write_text(json.dumps({"step": step}))
    (path / MANIFEST).write_text(json.dumps({"step": step, "files": _inventory(path)}))
    return path


def test_complete_checkpoint_verifies(tmp_path):
    assert verify(fake_checkpoint(tmp_path, 3)) is None


def test_truncated_file_is_named_and_previous_checkpoint_used(tmp_path):
    fake_checkpoint(tmp_path, 2)
    newest = fake_checkpoint(tmp_path, 4)
    (tmp_path / LATEST).write_text(newest.name)
    (newest / "weights" / "shard.distcp").write_bytes(b"short")
    found, skipped = find_resumable(tmp_path)
    assert found == tmp_path / "step_000002"
    assert len(skipped) == 1 and "step_000004" in skipped[0] and "weights/shard.distcp has 5 bytes" in skipped[0]


def test_partial_save_without_manifest_is_skipped(tmp_path):
    fake_checkpoint(tmp_path, 1)
    partial = fake_checkpoint(tmp_path, 5)
    (partial / MANIFEST).unlink()
    found, skipped = find_resumable(tmp_path)
    assert found.name == "step_000001"
    assert "no MANIFEST.json" in skipped[0]


def test_missing_file_and_no_checkpoint(tmp_path):
    only = fake_checkpoint(tmp_path, 1)
    (only / "weights" / "shard.distcp").unlink()
    found, skipped = find_resumable(tmp_path)
    assert found is None and "missing file weights/shard.distcp" in skipped[0]
    assert find_resumable(tmp_path / "absent") == (None, [])


def test_prune_keeps_the_newest_complete(tmp_path):
    for step in (1, 2, 3, 4):
        fake_checkpoint(tmp_path, step)
    _prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003", "step_000004"]


def test_metrics_are_cut_back_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n" for s in range(6)))
    truncate_metrics(path, 3)
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3]


def test_metrics_log_writes_jsonl_and_console(tmp_path):
    lines = []

    class Stream:
        def write(self, text):
            lines.append(text)

        def flush(self):
            pass

    log = MetricsLog(tmp_path, total_steps=10, wandb_mode="disabled", stream=Stream())
    log.step(1, {"reward/mean": 0.25, "eval/accuracy": 0.5, "time/generate_s": 1.25, "actor/kl": 0.001})
    log.close()
    (record,) = read_metrics(tmp_path / "metrics.jsonl")
    assert {k: v for k, v in record.items() if k not in WALL_CLOCK} == {
        "step": 1, "actor/kl": 0.001, "eval/accuracy": 0.5, "reward/mean": 0.25, "time/generate_s": 1.25}
    console = "".join(lines)
    assert "step 1/10" in console and "reward 0.250" in console and "eval-acc 0.500" in console
    assert "generate 1.2" in console
