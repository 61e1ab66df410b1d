"""Checkpoint directory handling without processes: completeness and checksum checks, the
fallback to the previous checkpoint, the refusals before a resume, and the metrics file cut back
to the checkpoint on resume."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_rl.checkpoint.manifest import _inventory
from megatron_rl.checkpoint.store import LATEST, MANIFEST, STATE, STATE_VERSION, _prune, find_resumable, verify
from megatron_rl.checkpoint.config_change import config_differences
from megatron_rl.checkpoint.manager import check_run_directory
from megatron_rl.config import load_config, to_dict
from megatron_rl.errors import ConfigError
from megatron_rl.observability.metrics_log import WALL_CLOCK, MetricsLog, read_metrics, truncate_metrics


def fake_checkpoint(root: Path, step: int, config: dict | None = None) -> Path:
    path = root / f"step_{step:06d}"
    (path / "weights").mkdir(parents=True)
    (path / "weights" / "shard.distcp").write_bytes(b"x" * (100 + step))
    # a real torch_dist index beside it: resuming reads it (checkpoint/unpickling.py)
    dcp.save({"weight": torch.zeros(2)}, checkpoint_id=str(path / "weights"), no_dist=True)
    (path / STATE).write_text(json.dumps({"step": step, "version": STATE_VERSION, "config": config or {}}))
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


def test_bytes_flipped_in_place_are_named_and_previous_checkpoint_used(tmp_path, flip_bytes_in_place):
    fake_checkpoint(tmp_path, 2)
    newest = fake_checkpoint(tmp_path, 4)
    flip_bytes_in_place(newest / "weights" / "shard.distcp")
    assert verify(newest, checksums=False) is None  # same size: a size check cannot see it
    found, skipped = find_resumable(tmp_path)
    assert found == tmp_path / "step_000002"
    assert "weights/shard.distcp is corrupt (CRC-32" in skipped[0], skipped


@pytest.mark.parametrize("entry, named", [
    ("../../../../../../etc/passwd", "'../../../../../../etc/passwd' lies outside"),
    ("/etc/passwd", "'/etc/passwd' lies outside"),
    ("escape", "'escape' leads outside"),  # a symbolic link in the checkpoint to a file beyond it
    ("weights/../weights/shard.distcp", "lies outside"),
    ("./trainer_state.json", "'./trainer_state.json' names a file listed before"),
    ("repeated", "entry 'trainer_state.json' is listed twice"),  # the same key twice in the JSON
    ("sizeless", "'trainer_state.json' needs its \"bytes\""),
    ("not a mapping", '"files" must map each file name to its size and CRC-32, not a list'),
])
def test_a_manifest_entry_outside_its_checkpoint_is_refused_at_the_first_read(tmp_path, entry, named):
    """MANIFEST.json is untrusted input: an entry naming a file outside the checkpoint (which
    verify_files used to read), twice, or without a size is refused naming the manifest file and
    the entry, by every reader: verify (resume), check_intact (init_from, conversions, verify-hf)
    and a LoRA run's base reference (init_from copied the entries into it, and its resume then
    blamed an edit of megatron_rl.json)."""
    from megatron_rl.checkpoint import base_ref
    from megatron_rl.checkpoint.format import check_intact

    path = fake_checkpoint(tmp_path / "checkpoints", 3)
    manifest = path / MANIFEST
    files = json.loads(manifest.read_text())["files"]
    (tmp_path / "secret").write_text("not the checkpoint's")
    (path / "escape").symlink_to(tmp_path / "secret")
    size = {"bytes": 1, "crc32": "00000000"}
    if entry == "repeated":
        text = manifest.read_text().replace('"trainer_state.json"',
                                            '"trainer_state.json": {"bytes": 1}, "trainer_state.json"')
    elif entry == "sizeless":
        text = json.dumps({"files": dict(files, **{"trainer_state.json": {"crc32": "00000000"}})})
    elif entry == "not a mapping":
        text = json.dumps({"files": sorted(files.items())})
    else:
        text = json.dumps({"files": dict(files, **{entry: size})})
    manifest.write_text(text)
    problem = verify(path)
    assert problem is not None and str(manifest) in problem and named in problem, problem
    assert "edited or damaged" in problem, problem
    found, skipped = find_resumable(tmp_path / "checkpoints")
    assert found is None and named in skipped[0], skipped
    with pytest.raises(ConfigError, match="edited or damaged") as refused:
        check_intact(path)
    assert str(manifest) in str(refused.value) and named in str(refused.value)
    (path / "megatron_rl.json").write_text(json.dumps({"format": "megatron_rl.torch_dist.v1", "weights_dir": "weights",
                                                      "padded_vocab_size": 128, "precision": "fp32"}))
    with pytest.raises(ConfigError, match="edited or damaged") as refused:
        base_ref.describe_source(path)  # a LoRA run's checkpoint.init_from: its base reference
    assert str(manifest.resolve()) in str(refused.value) and named in str(refused.value)


@pytest.mark.parametrize("where", ["../outside.distcp", "link.distcp"])
def test_a_torch_dist_index_naming_a_file_outside_the_weights_is_refused(tmp_path, where):
    """The torch_dist index (.metadata) names the file of every stored tensor, and torch's reader
    opens it: a name leading out of the weights directory (`..`, a symbolic link) is refused by
    the check every torch_dist loader runs first (format.check_weight_files), naming the index
    and the file."""
    import pickle

    from megatron_rl.checkpoint.format import check_weight_files

    weights = fake_checkpoint(tmp_path, 1) / "weights"
    index = pickle.loads((weights / ".metadata").read_bytes())
    (stored,) = {item.relative_path for item in index.storage_data.values()}
    (weights / stored).rename(tmp_path / "outside.distcp")
    (weights / "link.distcp").symlink_to(tmp_path / "outside.distcp")
    for item in index.storage_data.values():
        item.relative_path = where
    (weights / ".metadata").write_bytes(pickle.dumps(index))
    with pytest.raises(ConfigError) as refused:
        check_weight_files(weights)
    message = str(refused.value)
    assert f"{weights / '.metadata'}: a stored tensor's file {where!r} " in message, message
    assert ("leads outside" if where.startswith("link") else "lies outside") in message, message


def test_checkpoint_of_an_older_format_is_named(tmp_path):
    path = fake_checkpoint(tmp_path, 1)
    (path / STATE).write_text(json.dumps({"step": 1}))
    (path / MANIFEST).write_text(json.dumps({"step": 1, "files": _inventory(path)}))
    assert "older megatron-rl (checkpoint format 1" in verify(path)


def run_config(tmp_path: Path, *overrides: str):
    return load_config(None, [f"output_dir={tmp_path}", *overrides])


def test_resume_auto_refuses_when_every_checkpoint_is_unusable(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4):
        (fake_checkpoint(root, step) / "weights" / "shard.distcp").write_bytes(b"short")
    with pytest.raises(ConfigError) as error:
        check_run_directory(run_config(tmp_path))
    message = str(error.value)
    assert "step_000004: file weights/shard.distcp has 5 bytes" in message and "step_000002" in message
    assert "checkpoint.resume=none" in message and "previous-<time>" in message
    check_run_directory(run_config(tmp_path, "checkpoint.resume=none"))  # starting over is allowed


def test_resume_with_another_config_is_refused_naming_the_keys(tmp_path):
    recorded = to_dict(run_config(tmp_path))
    del recorded["rl"]["temperature"]  # a key the recorded config lacks counts as its default
    fake_checkpoint(tmp_path / "checkpoints", 3, config=recorded)
    check_run_directory(run_config(tmp_path, "parallel.tp=1", "logging.wandb_mode=disabled"))
    with pytest.raises(ConfigError, match=r"rl.steps: 150 -> 7") as error:
        check_run_directory(run_config(tmp_path, "rl.steps=7", "optimizer.lr=0.5"))
    assert "optimizer.lr" in str(error.value) and "rl.temperature" not in str(error.value)
    check_run_directory(run_config(tmp_path, "rl.steps=7", "checkpoint.allow_config_change=true"))


def test_allowed_config_change_refuses_by_name_what_a_resume_cannot_apply(tmp_path):
    """checkpoint.allow_config_change accepts changes that take effect on resume (the optimizer's:
    test_resharding.py::test_changed_optimizer_settings_take_effect_on_resume) and refuses, by
    name, the ones a resume would silently ignore: the warm start never runs again, and the
    prompt order and random states come from the checkpoint, not the seed."""
    fake_checkpoint(tmp_path / "checkpoints", 3, config=to_dict(run_config(tmp_path)))
    allow = "checkpoint.allow_config_change=true"
    check_run_directory(run_config(tmp_path, allow, "optimizer.weight_decay=0.1", "optimizer.lr=1e-4", "rl.steps=7"))
    with pytest.raises(ConfigError) as error:
        check_run_directory(run_config(tmp_path, allow, "optimizer.weight_decay=0.1", "warm_start.steps=10", "seed=7"))
    message = str(error.value)
    assert "cannot apply these changes" in message and "warm_start.steps: 250 -> 10 (the warm start ran" in message
    assert "seed: 1234 -> 7 (the prompt order" in message and "weight_decay" not in message
    assert "checkpoint.resume=none" in message


def test_config_differences_ignore_layout_logging_and_checkpoint_keys(tmp_path):
    base = to_dict(run_config(tmp_path))
    other = to_dict(run_config(tmp_path / "elsewhere", "parallel.ep=2", "checkpoint.keep_last=5",
                               "logging.wandb_mode=disabled", "micro_batch_tokens=1024",
                               "model.moe_permute_fusion=true"))  # a throughput lever: the same step
    assert config_differences(base, other) == []
    changed = to_dict(run_config(tmp_path, "rl.recipe=grpo"))
    assert config_differences(base, changed) == ["rl.recipe: 'dapo' -> 'grpo'"]


def test_recorded_config_is_read_with_todays_spellings(tmp_path):
    """Checkpoints written when rl.routing_replay was a bool resume under its named modes."""
    recorded = to_dict(run_config(tmp_path))
    recorded["rl"]["routing_replay"] = True
    assert config_differences(recorded, to_dict(run_config(tmp_path, "rl.routing_replay=training"))) == []
    assert config_differences(recorded, to_dict(run_config(tmp_path, "rl.routing_replay=rollout"))) == [
        "rl.routing_replay: 'training' -> 'rollout'"]


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
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["step_000003", "step_000004"]
    deadline = time.monotonic() + 10  # the pruned ones are deleted in the background
    while time.monotonic() < deadline and len(list(tmp_path.iterdir())) > 2:
        time.sleep(0.05)
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


def test_write_results_queue_survives_the_stop_signals(tmp_path):
    """SLURM's preemption warning (USR1) and SIGTERM reach every process of the job. The process
    serving Megatron-Core's write-results queue must outlive them, or the stop checkpoint fails
    (it did, in the live SLURM preemption test, before the queue was started our way)."""
    import subprocess
    import sys

    script = tmp_path / "results_queue_check.py"  # not queue.py: it would shadow the stdlib module
    script.write_text("""
import os, signal, time
from megatron_rl.checkpoint.store import start_write_results_queue
start_write_results_queue()
from megatron.core.dist_checkpointing.strategies import filesystem_async
queue = filesystem_async._results_queue
server = queue._manager._process.pid
for number in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
    os.kill(server, number)

def pending(pid):  # signals sent to the process and not yet taken (a delivered SIGTERM kills at once)
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
    return int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)

deadline = time.monotonic() + 30
while pending(server) and time.monotonic() < deadline:
    time.sleep(0.01)
assert not pending(server), "the queue's process never took the signals"
queue.put({"written": 1})
print("alive", queue.get_nowait())
""")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "alive {'written': 1}" in result.stdout
