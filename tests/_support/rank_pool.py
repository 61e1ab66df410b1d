"""Rank pools: one set of ranks per world size, running test worker scripts job after job, instead
of one torchrun (and one import of torch, Megatron-Core and transformers per rank, about 12 s for
two ranks) per case. The ranks are forked from the pytest worker's pre-imported server
(zygote.py) with the environment torchrun gives its ranks, so a pool costs no import either. A pool serves its module to the end: its gloo groups are made once and reused by
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
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from _support.processes import child_env, free_port, python_command

SERVER = Path(__file__).with_name("rank_server.py")
# A rank that failed leaves the others where they were: the ones still running get this long to
# finish (most are waiting in a collective that will not complete) before the pool is stopped.
GRACE_S = 20.0


def rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """What torchrun's static single-node launch puts in each rank's environment."""
    return child_env(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default",
                     WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0",
                     TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none")


class RankPool:
    """`nproc` ranks of rank_server.py, each forked from the pre-imported server."""

    def __init__(self, nproc: int, root: Path):
        self.nproc, self.jobs = nproc, Path(tempfile.mkdtemp(prefix=f"ranks{nproc}-", dir=root))
        self.log = open(self.jobs / "ranks.log", "ab")
        port = free_port()
        self.processes = [subprocess.Popen(python_command(SERVER, self.jobs, preloaded=True),
                                           env=rank_env(rank, nproc, port), stdout=self.log,
                                           stderr=subprocess.STDOUT, start_new_session=True)
                          for rank in range(nproc)]
        self.next = 0

    def alive(self) -> bool:
        return all(process.poll() is None for process in self.processes)

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
                f"\n---- the ranks' own output ----\n{self._read(self.jobs / 'ranks.log')[-3000:]}"
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
        """Idle ranks leave on the stop file; then SIGTERM to the ranks still in a job, then SIGKILL
        (a rank's client that dies takes its forked rank with it)."""
        self.ask_to_stop()
        for ask, wait_s in ((None, 2), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            running = [process for process in self.processes if process.poll() is None]
            if not running:
                break
            for process in running if ask is not None else ():
                process.send_signal(ask)
            deadline = time.monotonic() + wait_s
            for process in running:
                try:
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
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
