"""AtomicDirectory on one process: --force replaces a file or a directory and leaves nothing
aside; an interrupted or failed write leaves neither output nor staging directory."""

import signal

import pytest

from megatron_rl.checkpoint.atomic_dir import AtomicDirectory


def _write(out, force=False):
    with AtomicDirectory(out, force=force) as staging:
        (staging / "weights.bin").write_text("new")


@pytest.mark.parametrize("existing", ["file", "directory"])
def test_force_replaces_and_leaves_nothing_aside(tmp_path, existing):
    out = tmp_path / "out"
    if existing == "file":
        out.write_text("old file")
    else:
        out.mkdir()
        (out / "old.txt").write_text("old")
    _write(out, force=True)
    assert (out / "weights.bin").read_text() == "new" and not (out / "old.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no .out.old-* and no .out.partial-*


def test_existing_file_is_refused_without_force(tmp_path):
    (tmp_path / "out").write_text("keep")
    with pytest.raises(ValueError, match="already exists; pass --force"):
        _write(tmp_path / "out")
    assert (tmp_path / "out").read_text() == "keep"


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit, RuntimeError])
def test_interrupted_or_failed_write_leaves_nothing(tmp_path, error):
    with pytest.raises(error):
        with AtomicDirectory(tmp_path / "out") as staging:
            (staging / "half.bin").write_text("half")
            raise error()
    assert list(tmp_path.iterdir()) == []


def test_sigterm_turned_into_an_exception_leaves_nothing(tmp_path):
    def stop(number, frame):
        raise KeyboardInterrupt(f"signal {number}")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(KeyboardInterrupt):
            with AtomicDirectory(tmp_path / "out") as staging:
                (staging / "half.bin").write_text("half")
                signal.raise_signal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert list(tmp_path.iterdir()) == []


def test_signals_are_held_during_publish_and_delivered_after():
    from megatron_rl.checkpoint.atomic_dir import signals_deferred

    received = []
    previous = signal.signal(signal.SIGTERM, lambda number, frame: received.append(number))
    try:
        with signals_deferred():
            signal.raise_signal(signal.SIGTERM)
            assert received == []
        assert received == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
