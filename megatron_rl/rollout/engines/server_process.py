"""What every HTTP rollout server we start or talk to shares: the process (log file, readiness,
teardown of its whole process group) and the engine-side health checks."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from megatron_rl.rollout.engines.http import JsonClient
from megatron_rl.rollout.protocol import (EngineError, EngineTimeout, EngineUnauthorized, EngineUnavailable,
                                          check_grouping)
from megatron_rl.runtime.cpu.vllm_shm import ServerSegments


class ServerProcess:
    """A server we started; owns the process and its log file."""

    def __init__(self, process: subprocess.Popen, url: str, log_path: Path, name: str):
        self.process, self.url, self.log_path, self.name = process, url, log_path, name
        # Its processes' shared memory (vLLM's CPU workers, message queues), removed after stop().
        self.segments = ServerSegments()

    @classmethod
    def launch(cls, command: list[str], *, env: dict, url: str, log_path: str | Path, name: str,
               startup_timeout_s: float, served_model: str | None = None):
        """Start `command` in its own process group (teardown then reaches every process the server
        spawns), logging to `log_path`, and wait until it is ready (wait_ready). `served_model`:
        the model id its /v1/models lists (vLLM's and SGLang's: the model path given)."""
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        server = cls(process, url, log_path, name)
        try:
            server.wait_ready(startup_timeout_s, served_model)
        except BaseException:
            server.stop()
            raise
        server.segments.note(_group_members(process.pid))  # the engine is up: its segments exist
        return server

    def wait_ready(self, timeout_s: float, served_model: str | None = None) -> None:
        """Until the server answers as ours: /health, then /v1/models with this job's token (a
        server refusing the token is another job's) listing `served_model` where given (a server
        that checks no token but serves another model is not ours either)."""
        client = JsonClient(self.name, self.url, timeout_s=5, max_retries=0)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EngineUnavailable(
                    f"{self.name}: server exited with code {self.process.returncode} while starting; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                client.get("/health", retries=0)
            except EngineError:
                time.sleep(1.0)
                continue
            # /health is open to anyone: a server that is not ours (one that held the port before
            # ours could bind it) answers it too. Only ours accepts this job's token.
            try:
                models = client.get("/v1/models", retries=0)
            except EngineUnauthorized as exc:
                raise EngineUnavailable(
                    f"{self.name}: another server already listens at {self.url} (it refused this job's rollout "
                    f"token); free that port or choose another one") from exc
            except (EngineUnavailable, EngineTimeout):
                time.sleep(1.0)
                continue
            except EngineError:
                return  # answered with another HTTP status (a server without that route): up, and it took the token
            served = _model_ids(models)
            if served_model is not None and served is not None and served_model not in served:
                raise EngineUnavailable(
                    f"{self.name}: another server already listens at {self.url} (it serves {sorted(served)}, not "
                    f"{served_model}); free that port or choose another one")
            return
        raise EngineTimeout(f"{self.name}: not ready after {timeout_s:.0f}s; see {self.log_path}:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the server's whole process group, SIGKILL to what is left after `grace_s`.
        Also when the main process is already gone: its engine-core and worker processes outlive
        it (a GPU's memory with them) unless the group is signalled. Then the shared memory its
        processes mapped and left in /dev/shm goes (vllm_shm.ServerSegments)."""
        group = self.process.pid  # launched with start_new_session: the group's id is the server's pid
        try:
            self._stop_group(group, grace_s)
        finally:
            # A worker killed with SIGKILL (here, or before) leaves its shared memory in /dev/shm.
            self.segments.remove()

    def _stop_group(self, group: int, grace_s: float) -> None:
        if not _group_alive(group):
            self.process.poll()
            return
        self.segments.note(_group_members(group))
        _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while _group_alive(group) and time.monotonic() < deadline:
            self.process.poll()  # reaps the main process, our child; the others are its children
            time.sleep(0.1)
        if _group_alive(group):
            _signal_group(group, signal.SIGKILL)
            while _group_alive(group) and time.monotonic() < deadline + 10:
                self.process.poll()
                time.sleep(0.1)
        self.process.poll()


def _model_ids(models) -> set[str] | None:
    """The ids an OpenAI-style /v1/models answer lists (None: not that shape, nothing to compare)."""
    if not isinstance(models, dict) or not isinstance(models.get("data"), list):
        return None
    return {entry["id"] for entry in models["data"] if isinstance(entry, dict) and isinstance(entry.get("id"), str)}


def _signal_group(group: int, number: int) -> None:
    try:
        os.killpg(group, number)
    except ProcessLookupError:
        pass


def _group_members(group: int) -> list[int]:
    """The pids of `group`'s processes."""
    members = []
    for process in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(process.pid) == group:
                members.append(process.pid)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return members


def _group_alive(group: int) -> bool:
    """Whether a process of `group` still runs (a zombie left for its parent to reap does not count)."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    for process in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(process.pid) == group and process.status() != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.NoSuchProcess, psutil.ZombieProcess, PermissionError):
            continue
    return False


class ServerEngineBase:
    """Health and liveness for an engine behind HTTP (`self._client`, optional `self.process`)."""

    name: str
    url: str
    process: ServerProcess | None
    health_timeout_s: float = 10.0
    max_concurrency: int = 64
    _closed: bool = False

    def health(self) -> None:
        if self._closed:
            raise EngineUnavailable(f"{self.name}: engine was shut down")
        self._raise_if_dead()
        try:
            self._client.get("/health", timeout_s=self.health_timeout_s, retries=1)
        except EngineError as exc:
            raise EngineUnavailable(f"{self.name}: health check at {self.url} failed: {exc}") from exc

    def _per_prompt(self, request, prompts, params, timeout: float):
        """`request(index, prompt, params, timeout) -> [Sample]` for every prompt, concurrently (at
        most `self.max_concurrency` in flight), results in prompt order. On an engine error the
        rest is cancelled and a dead server is reported as such."""
        with ThreadPoolExecutor(max_workers=min(len(prompts), self.max_concurrency)) as pool:
            futures = [pool.submit(request, index, prompt, params, timeout) for index, prompt in enumerate(prompts)]
            try:
                groups = [future.result() for future in futures]
            except EngineError:
                for future in futures:
                    future.cancel()
                self._raise_if_dead()
                raise
        check_grouping(self.name, prompts, params, groups)
        return groups

    def _raise_if_dead(self) -> None:
        if self.process is not None and not self.process.alive():
            raise EngineUnavailable(
                f"{self.name}: server process exited with code {self.process.process.returncode}; "
                f"last lines of {self.process.log_path}:\n{self.process.log_tail()}"
            )
