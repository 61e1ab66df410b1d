"""Write a directory so that it appears complete or not at all, from one or many ranks.

    with AtomicDirectory(out, force=False) as staging:   # every rank enters, same staging path
        ... write files under staging ...
    # on success rank 0 renames staging -> out; on failure staging is removed, out untouched

An existing `out` is refused unless force=True; with force the old directory is replaced only
after the new one is complete (rename old aside, rename new in, delete old).
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import torch.distributed as dist

from megatron_rl.config import ConfigError


def refuse_existing(out: str | Path, force: bool) -> None:
    out = Path(out)
    if out.exists() and not force:
        raise ConfigError(f"output directory {out} already exists; pass --force to replace it")


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


class AtomicDirectory:
    def __init__(self, out: str | Path, force: bool = False):
        self.out = Path(out)
        self.force = force
        self.rank0 = not dist.is_initialized() or dist.get_rank() == 0
        self.staging: Path | None = None

    def __enter__(self) -> Path:
        refuse_existing(self.out, self.force)
        name = [f".{self.out.name}.partial-{uuid.uuid4().hex[:8]}"]
        if _distributed():
            dist.broadcast_object_list(name, src=0)
        self.staging = self.out.parent / name[0]
        if self.rank0:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.staging.mkdir()
        if _distributed():
            dist.barrier()
        return self.staging

    def __exit__(self, exc_type, exc, tb) -> bool:
        ok = exc_type is None
        if _distributed():
            verdicts = [None] * dist.get_world_size()
            dist.all_gather_object(verdicts, ok)
            ok = all(verdicts)
        if self.rank0:
            if ok:
                self._publish()
            else:
                shutil.rmtree(self.staging, ignore_errors=True)
        if _distributed():
            dist.barrier()
        if not ok and exc_type is None:
            raise RuntimeError(f"another rank failed while writing {self.out}; nothing was written")
        return False

    def _publish(self) -> None:
        old = None
        if self.out.exists():
            if not self.force:  # appeared while we were writing
                shutil.rmtree(self.staging, ignore_errors=True)
                raise ConfigError(f"output directory {self.out} appeared during the write; nothing was replaced")
            old = self.out.parent / f".{self.out.name}.old-{uuid.uuid4().hex[:8]}"
            self.out.rename(old)
        self.staging.rename(self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
