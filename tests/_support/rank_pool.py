"""Rank pools: one torchrun per world size, running test worker scripts job after job, instead of
one torchrun (and one import of torch, Megatron-Core and transformers per rank, about 12 s for two
ranks) per case. A pool serves its module to the end: its gloo groups are made once and reused by
every job (rank_server.py), so jobs leave no threads behind.

    def test_something(rank_pools):                       # the module fixture (tests/conftest.py)
        result = rank_pools.run(WORKER, 2, "--out", str(out), paths=[WORKER.parent])
        assert result.returncode == 0, result.stderr

`run` has the shape of `subprocess.run(torchrun_command(WORKER, 2, ...), capture_output=True)`:
a CompletedProcess whose stdout is empty and whose stderr holds every rank's output, so a test
reports a failing worker as before. Each job runs as the script would in a fresh process (see
rank_server.py for what is reset between jobs and what is not: the world is kept). A job that
fails or hangs on some rank takes its pool down with it (its other ranks may be waiting in a
collective); the next job starts a new pool.

Only for the tests' own worker scripts: what a user starts (the CLI, tools/) keeps its own
process in the tests, as it has in use.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from _support.processes import child_env, torchrun_command

SERVER = Path(__file__).with_name("rank_server.py")
# A rank that failed leaves the others where they were: the ones still running get this long to
# finish (most are waiting in a collective that will not complete) before the pool is stopped.
GRACE_S = 20.0


class RankPool:
    """`nproc` ranks of rank_server.py under one torchrun."""

    def __init__(self, nproc: int, root: Path):
        self.nproc, self.jobs = nproc, Path(tempfile.mkdtemp(prefix=f"ranks{nproc}-", dir=root))
        self.log = open(self.jobs / "torchrun.log", "wb")
        self.process = subprocess.Popen(torchrun_command(SERVER, nproc, str(self.jobs)), env=child_env(),
                                        stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.next = 0

    def alive(self) -> bool:
        return self.process.poll() is None

    def run(self, script: Path, args: list[str], paths: list[str], timeout: float) -> subprocess.CompletedProcess:
        index, self.next = self.next, self.next + 1
        staged = self.jobs / f"{index}.json.tmp"
        staged.write_text(json.dumps({"script": str(script), "argv": [str(a) for a in args], "paths": paths}))
        staged.rename(self.jobs / f"{index}.json")
        codes = self._wait(index, timeout)
        output = "\n".join(f"---- rank {rank} ----\n{self._read(self.jobs / f'{index}.rank{rank}.log')}"
                           for rank in range(self.nproc))
        if any(code != 0 for code in codes.values()) or len(codes) < self.nproc:
            missing = sorted(set(range(self.nproc)) - set(codes))
            self.stop()  # ranks left in a collective, or a server gone: never reused
            output += (f"\n---- ranks {missing} did not finish" if missing else "") + \
                f"\n---- torchrun ----\n{self._read(self.jobs / 'torchrun.log')[-3000:]}"
        code = next((c for c in codes.values() if c != 0), 0 if len(codes) == self.nproc else 1)
        return subprocess.CompletedProcess([str(script), *args], code, "", output)

    def _wait(self, index: int, timeout: float) -> dict[int, int]:
        codes: dict[int, int] = {}
        deadline = time.monotonic() + timeout
        while len(codes) < self.nproc and time.monotonic() < deadline and self.alive():
            for rank in range(self.nproc):
                done = self.jobs / f"{index}.rank{rank}.done"
                if rank not in codes and done.exists():
                    codes[rank] = int(done.read_text())
                    if codes[rank] != 0:  # the others get a grace period, not the whole timeout
                        deadline = min(deadline, time.monotonic() + GRACE_S)
            time.sleep(0.05)
        return codes

    @staticmethod
    def _read(path: Path) -> str:
        return path.read_text(errors="replace") if path.exists() else ""

    def ask_to_stop(self) -> None:
        (self.jobs / "stop").write_text("")

    def stop(self) -> None:
        """Idle ranks leave on the stop file; then torchrun's SIGTERM (which it passes to ranks still
        in a job), then SIGKILL to the whole process group."""
        self.ask_to_stop()
        kill = lambda: os.killpg(self.process.pid, signal.SIGKILL)  # noqa: E731
        for ask, wait_s in ((None, 2), (self.process.terminate, 10), (kill, 10)):
            if not self.alive():
                break
            if ask is not None:
                ask()
            try:
                self.process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
        self.log.close()


class RankPools:
    """A test module's pools, one per world size, started on first use."""

    def __init__(self, root: Path):
        self.root, self.pools = root, {}

    def run(self, script: Path, nproc: int, *args, paths=(), timeout: float = 600) -> subprocess.CompletedProcess:
        pool = self.pools.get(nproc)
        if pool is None or not pool.alive():
            pool = self.pools[nproc] = RankPool(nproc, self.root)
        return pool.run(Path(script), list(args), [str(p) for p in paths], timeout)

    def stop(self) -> None:
        for pool in self.pools.values():
            pool.ask_to_stop()  # all at once: their ranks leave together
        for pool in self.pools.values():
            pool.stop()
