"""Write a directory so that it appears complete or not at all, from one or many ranks.

    with AtomicDirectory(out, force=False) as staging:   # every rank enters, same staging path
        ... write files under staging ...
    # on success rank 0 renames staging -> out; on failure staging is removed, out untouched

An existing `out` is refused unless force=True; with force the old directory (or file) is replaced
only after the new one is complete (rename old aside, rename new in, delete old). `owner` (the
command, for outputs a user names): the output carries its marker, and force replaces only an
earlier output with the same marker (checkpoint/output_guard.py).

Interrupted writes (KeyboardInterrupt, or SystemExit/KeyboardInterrupt raised by a SIGTERM
handler) remove the staging directory too, without any collective: the other ranks may be
anywhere, even blocked in a collective that will never complete, so each rank removes it itself.
"""

from __future__ import annotations

import shutil
import signal
import sys
import threading
import uuid
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from megatron_rl.checkpoint.output_guard import mark, refuse_existing
from megatron_rl.errors import ConfigError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def remove_path(path: Path) -> None:
    """Delete a directory tree, a file or a link; raises OSError if something stays."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextmanager
def stop_signals_handled(handler):
    """SIGINT and SIGTERM go to `handler(number, frame)` inside the block, the previous handlers
    come back after it. Python runs signal handlers in the main thread only: elsewhere this
    changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.signal(number, handler) for number in STOP_SIGNALS}
    try:
        yield
    finally:
        for number, before in previous.items():
            signal.signal(number, signal.SIG_DFL if before is None else before)


@contextmanager
def signals_deferred():
    """Hold SIGINT/SIGTERM until the block ends, so a rename sequence or a clean-up is never cut
    in half; a signal that arrived meanwhile is re-raised afterwards, to the handler from before."""
    pending: list[int] = []
    try:
        with stop_signals_handled(lambda number, frame: pending.append(number)):
            yield
    finally:
        for number in pending[:1]:
            signal.raise_signal(number)


class AtomicDirectory:
    def __init__(self, out: str | Path, force: bool = False, owner: str | None = None):
        self.out = Path(out)
        self.force = force
        self.owner = owner
        self.rank0 = not dist.is_initialized() or dist.get_rank() == 0
        self.staging: Path | None = None

    def __enter__(self) -> Path:
        refuse_existing(self.out, self.force, self.owner)
        name = [f".{self.out.name}.partial-{uuid.uuid4().hex[:8]}"]
        if _distributed():
            dist.broadcast_object_list(name, src=0)
        self.staging = self.out.parent / name[0]
        try:
            if self.rank0:
                self.out.parent.mkdir(parents=True, exist_ok=True)
                self.staging.mkdir()
                if self.owner is not None:
                    mark(self.staging, self.owner)
            if _distributed():
                dist.barrier()
        except BaseException:
            self._discard()  # __exit__ does not run when __enter__ fails
            raise
        return self.staging

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None and not issubclass(exc_type, Exception):
            self._discard()  # interrupted: no collectives (see the module docstring)
            return False
        try:
            ok = self._all_ranks_succeeded(exc_type is None)
        except BaseException:
            self._discard()  # the process group broke (a rank died) or we were interrupted
            if exc_type is None:
                raise
            return False  # the original exception is the one to report
        if self.rank0:
            if ok:
                self._publish()
            else:
                self._discard()
        if _distributed():
            dist.barrier()
        if not ok and exc_type is None:
            raise RuntimeError(f"another rank failed while writing {self.out}; nothing was written")
        return False

    def _all_ranks_succeeded(self, ok: bool) -> bool:
        if not _distributed():
            return ok
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, ok)
        return all(verdicts)

    def _discard(self) -> None:
        if self.staging is not None:
            with signals_deferred():
                shutil.rmtree(self.staging, ignore_errors=True)

    def _publish(self) -> None:
        with signals_deferred():
            old = None
            if self.out.exists() or self.out.is_symlink():
                try:  # appeared (or was swapped for something else) while we were writing
                    refuse_existing(self.out, self.force, self.owner)
                except ConfigError as exc:
                    shutil.rmtree(self.staging, ignore_errors=True)
                    raise ConfigError(f"{exc} (it appeared during the write; nothing was replaced)") from None
                old = self.out.parent / f".{self.out.name}.old-{uuid.uuid4().hex[:8]}"
                self.out.rename(old)
            self.staging.rename(self.out)
        if old is not None:
            self._remove_replaced(old)

    def _remove_replaced(self, old: Path) -> None:
        """Delete what --force replaced (a directory or a file); the new output is already in place,
        so a failure here is reported, not raised."""
        try:
            with signals_deferred():
                remove_path(old)
        except OSError as exc:
            print(f"warning: {self.out} was written, but the previous {self.out.name} (moved aside to {old}) "
                  f"could not be deleted ({exc}); delete it by hand", file=sys.stderr)
