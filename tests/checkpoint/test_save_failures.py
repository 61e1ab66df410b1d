"""A save that fails during the run (disk full, a directory made unwritable): one line naming the
path and what is kept, not a traceback, on every rank; the checkpoints before it stay intact and
`latest` keeps naming the newest of them. In this process, through store.begin_save with a stand-in
policy whose Megatron write request writes (or fails to write) one file, on a one-rank world."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from _support.world import world  # noqa: F401
from megatron_rl.checkpoint import store
from megatron_rl.checkpoint.manager import CheckpointManager
from megatron_rl.errors import TrainingStopped


class StandInRequest:
    """What Megatron-Core's async save returns: a write function with its buckets, no finalize."""

    def __init__(self, weights: Path, fail: OSError | None):
        self.file, self.fail = weights / "__0_0.distcp", fail
        self.async_fn_args = [None, [(str(self.file), "key", None)]]
        self.preload_fn = None
        self.finalize_fns = []

    def async_fn(self, *args) -> None:
        if self.fail is not None:
            raise self.fail
        self.file.write_bytes(b"weights")


class StandInPolicy:
    def __init__(self):
        self.fail = None

    def save_training_state(self, directory, *, keyed_like_weights, async_save, without_frozen):
        Path(directory).mkdir(parents=True, exist_ok=True)
        return {"optimizer": "state"}, StandInRequest(Path(directory), self.fail)


def save(root: Path, step: int, policy, async_save: bool):
    pending = store.begin_save(root, step, policy, {"config": {}}, keep_last=3, keyed_like_weights={},
                               metadata={"format": "test"}, hf_files={"config.json": b"{}"}, async_save=async_save,
                               device=torch.device("cpu"))
    if pending.process is not None:
        assert pending.poll(blocking=True)
    return pending


def assert_only_the_first_is_kept(root: Path) -> None:
    assert (root / store.LATEST).read_text().strip() == "step_000001"
    assert store.verify(root / "step_000001") is None
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]  # no staging directory left


@pytest.mark.parametrize("async_save", [False, True], ids=["synchronous", "asynchronous"])
def test_a_disk_that_fills_at_a_later_save_stops_the_run_in_one_line_keeping_the_earlier_checkpoint(
        world, tmp_path, async_save):  # noqa: F811
    root, policy = tmp_path / "checkpoints", StandInPolicy()
    save(root, 1, policy, async_save)
    assert_only_the_first_is_kept(root)
    policy.fail = OSError(errno.ENOSPC, "No space left on device", str(root / "weights.distcp"))
    with pytest.raises(TrainingStopped) as stop:
        save(root, 2, policy, async_save)
    message = str(stop.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint step_000002 could not be written into {root}: OSError: [Errno 28] No "
                              f"space left on device: '{root / 'weights.distcp'}'. The run stops here; the "
                              f"checkpoints before it are kept ({root / 'step_000001'} is the latest)"), message
    assert_only_the_first_is_kept(root)


def test_a_checkpoints_directory_made_unwritable_stops_the_run_at_its_save(world, tmp_path, monkeypatch):  # noqa: F811
    """What `chattr +i checkpoints` does to the save (root ignores permission bits, so the refusal
    is stood in for: the staging directory's creation fails as it does there)."""
    root, policy = tmp_path / "checkpoints", StandInPolicy()
    save(root, 1, policy, async_save=False)
    mkdir = Path.mkdir

    def refused(path, *args, **kwargs):
        if path.parent == root:
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
        return mkdir(path, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refused)
    with pytest.raises(TrainingStopped, match=r"^checkpoint step_000002 could not be written into .*checkpoints: "
                                              r"PermissionError: \[Errno 1\] Operation not permitted: '.*\.step_000002"
                                              r"\.partial-\w+'\. The run stops here; the checkpoints before it are kept"):
        save(root, 2, policy, async_save=False)
    monkeypatch.undo()
    assert_only_the_first_is_kept(root)


def test_the_manager_forgets_a_failed_save_so_that_closing_the_run_does_not_raise_again(world, tmp_path):  # noqa: F811
    root, policy = tmp_path / "checkpoints", StandInPolicy()
    policy.fail = OSError(errno.ENOSPC, "No space left on device")
    manager = CheckpointManager.__new__(CheckpointManager)
    manager.pending = store.begin_save(root, 1, policy, {"config": {}}, keep_last=3, keyed_like_weights={},
                                       metadata={}, hf_files={}, async_save=True, device=torch.device("cpu"))
    with pytest.raises(TrainingStopped):
        manager._poll(blocking=True)
    assert manager.pending is None and manager.close(clean=True) == []
