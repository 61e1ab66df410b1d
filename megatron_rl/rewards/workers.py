"""A small pool of reward worker processes with a hard per-call timeout.

Why not ``concurrent.futures.ProcessPoolExecutor``: it cannot cancel a call that is already
running, so one ``while True: pass`` would occupy a worker forever (and block shutdown). Here
each worker has its own pipe and takes one call at a time; when a call passes its deadline the
parent kills that worker (SIGKILL), records a timeout for the call, and starts a replacement.
Other workers and their calls are not disturbed.

Processes start with "forkserver" (Linux) or "spawn", never "fork": the trainer process holds
threads, CUDA contexts and torch.distributed state that a forked child must not inherit. A
worker resolves its reward functions by name (``registry.resolve_reward``) when it starts, runs
each function's ``prepare`` warm-up, and reports ready; the timeout of a call starts when the
call is sent to a ready worker, so start-up and imports are never charged to a sample.

A call is either a ``Call`` (one sample of a per-sample function; its outcome is one ``Outcome``)
or a ``BatchCall`` (a chunk of samples for a batched function; its outcome is a list of
``Outcome`` per sample when the function returned, or one ``Outcome`` standing for every sample
of the chunk when the call raised, returned the wrong length, crashed its worker or timed out).
Each kind has its own timeout (``timeout_s``, ``batch_timeout_s``), counted per call.

A worker exits when its pipe closes (the parent is gone). A worker stuck in a hung function
never reads its pipe, so a watchdog thread watches the pipe during calls and exits the process
when the parent's end closes: a trainer that dies mid-batch leaves no spinning worker behind.
(Its parent process is no signal: forkserver children keep the fork server alive.)
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Literal, Mapping, Sequence

from megatron_rl.errors import raised_at
from megatron_rl.rewards.functions import as_batch_rewards, as_reward

__all__ = ["BatchCall", "Call", "Outcome", "WorkerPool", "WorkerStartError", "default_start_method"]

_WATCHDOG_PERIOD_S = 1.0
_JOIN_AFTER_KILL_S = 5.0


class WorkerStartError(RuntimeError):
    """A worker process could not start or resolve its reward functions."""


@dataclass(frozen=True)
class Call:
    """One reward evaluation: function ``fn_index`` of the pool's specs on one sample."""

    fn_index: int
    prompt: str
    response: str
    answer: str | None
    metadata: Mapping[str, Any]


@dataclass(frozen=True)
class BatchCall:
    """One call of batched function ``fn_index`` on a chunk of samples (lists of equal length;
    ``columns`` holds one list per metadata field, see ``functions.py``)."""

    fn_index: int
    prompts: list[str]
    responses: list[str]
    answers: list[str | None]
    columns: Mapping[str, list]

    def __len__(self) -> int:
        return len(self.prompts)


@dataclass(frozen=True)
class Outcome:
    status: Literal["ok", "error", "timeout"]
    value: float = 0.0
    message: str | None = None


def default_start_method() -> str:
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


# --------------------------------------------------------------------------- worker side


def _exit_when_orphaned(conn, busy: threading.Event) -> None:
    """Exit the process once the parent is gone, even while the main thread is stuck.

    While a call runs, the parent sends nothing (it waits for the reply), so the pipe becoming
    readable then means end-of-file: the parent died, or it is closing the pool. The main thread
    clears ``busy`` before it sends a reply, so the next call can never be mistaken for that.
    """
    while True:
        time.sleep(_WATCHDOG_PERIOD_S)
        if busy.is_set() and conn.poll(0):
            os._exit(1)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}{raised_at(exc)}"


def _worker_main(conn, specs: Sequence[tuple[str, dict]], sys_path: list[str]) -> None:
    # Ctrl-C reaches the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.path[:] = sys_path
    busy = threading.Event()
    threading.Thread(target=_exit_when_orphaned, args=(conn, busy), daemon=True).start()

    from megatron_rl.rewards.registry import resolve_reward

    try:
        functions = [resolve_reward(name, params) for name, params in specs]
        for function in functions:
            if function.prepare is not None:
                function.prepare()
    except (Exception, SystemExit) as exc:
        conn.send(("startup_error", _describe(exc)))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        call_id, call = message
        busy.set()
        try:
            reply = (call_id, _evaluate(functions[call.fn_index].fn, call))
        except (Exception, SystemExit) as exc:
            reply = (call_id, Outcome("error", 0.0, _describe(exc)))
        busy.clear()
        conn.send(reply)


def _evaluate(fn, call: Call | BatchCall) -> Outcome | list[Outcome]:
    """Run one call; an exception (or a batch result of the wrong shape) propagates to the caller."""
    if isinstance(call, Call):
        return Outcome("ok", as_reward(fn(call.prompt, call.response, call.answer, **call.metadata)))
    values = as_batch_rewards(fn(call.prompts, call.responses, call.answers, **call.columns), len(call))
    return [Outcome("error", 0.0, str(v)) if isinstance(v, Exception) else Outcome("ok", v) for v in values]


# --------------------------------------------------------------------------- parent side


class _Worker:
    def __init__(self, context, specs, startup_timeout_s: float):
        self.conn, child_conn = context.Pipe(duplex=True)
        self.process = context.Process(
            target=_worker_main, args=(child_conn, list(specs), list(sys.path)), daemon=True,
            name="megatron-rl-reward-worker",
        )
        self.process.start()
        child_conn.close()
        self.ready = False
        self.start_deadline = time.monotonic() + startup_timeout_s
        self.call: tuple[int, float, float] | None = None  # (index in the batch, deadline, limit) while busy

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(_JOIN_AFTER_KILL_S)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.process.join(1.0)
        self.kill()


class WorkerPool:
    """``num_workers`` processes evaluating calls of the functions ``specs`` = [(name, params)].

    Workers start lazily on the first ``run`` (so a run whose rewards all run inline never starts
    a process) and stay up between batches. ``close()`` (or the context manager) stops them.
    """

    def __init__(self, specs: Sequence[tuple[str, Mapping[str, Any]]], *, num_workers: int = 2,
                 timeout_s: float = 10.0, startup_timeout_s: float = 120.0, start_method: str | None = None,
                 batch_timeout_s: float | None = None):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        batch_timeout_s = timeout_s if batch_timeout_s is None else batch_timeout_s
        if not timeout_s > 0 or not startup_timeout_s > 0 or not batch_timeout_s > 0:
            raise ValueError(f"timeouts must be > 0, got timeout_s={timeout_s}, startup_timeout_s={startup_timeout_s}, "
                             f"batch_timeout_s={batch_timeout_s}")
        self.specs = [(name, dict(params)) for name, params in specs]
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.batch_timeout_s = batch_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.context = multiprocessing.get_context(start_method or default_start_method())
        self.workers: list[_Worker] = []
        self.restarts = 0  # workers replaced after a timeout or a crash, over the pool's life

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.workers = []

    def start(self) -> None:
        """Start the workers now, without waiting (so start-up overlaps other work)."""
        while len(self.workers) < self.num_workers:
            self.workers.append(self._start_worker())

    def _start_worker(self) -> _Worker:
        return _Worker(self.context, self.specs, self.startup_timeout_s)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        worker.ready, worker.call = False, None
        self.workers[self.workers.index(worker)] = self._start_worker()
        self.restarts += 1

    def run(self, calls: Sequence[Call | BatchCall]) -> list[Outcome | list[Outcome]]:
        """Evaluate every call; each outcome is ok, error (exception / bad value / crash) or timeout
        (for a BatchCall: a list of per-sample outcomes, or one outcome for all its samples).

        Raises WorkerStartError only when a worker cannot start at all (a broken environment, not
        a bad sample). On any exception (that one, or Ctrl-C) every worker is stopped, so no call
        of an abandoned batch stays in flight; the next ``run`` starts fresh workers.
        """
        outcomes: list[Outcome | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        self.start()
        try:
            while pending or any(worker.call for worker in self.workers):
                for worker in list(self.workers):
                    # A call that cannot be sent leaves the worker idle: give it the next one.
                    while worker.ready and worker.call is None and pending:
                        self._dispatch(worker, pending, calls, outcomes)
                self._wait_and_collect(calls, outcomes)
        except BaseException:
            self.close()
            raise
        assert all(outcome is not None for outcome in outcomes), "every call gets an outcome"
        return outcomes  # type: ignore[return-value]

    def _dispatch(self, worker: _Worker, pending: deque, calls: Sequence[Call], outcomes: list) -> None:
        index = pending.popleft()
        try:
            # Connection.send pickles the whole message before writing, so a value that cannot
            # be pickled fails here without leaving half a message in the pipe.
            payload = ForkingPickler.dumps((index, calls[index]))
        except Exception as exc:
            what = "the batch" if isinstance(calls[index], BatchCall) else "the sample"
            outcomes[index] = Outcome("error", 0.0, f"{what} cannot be sent to a worker: {_describe(exc)}")
            return
        try:
            worker.conn.send_bytes(payload)
        except OSError:  # the idle worker died (killed from outside): replace it, retry the call
            pending.appendleft(index)
            self._replace(worker)
            return
        limit = self.batch_timeout_s if isinstance(calls[index], BatchCall) else self.timeout_s
        worker.call = (index, time.monotonic() + limit, limit)

    def _wait_and_collect(self, calls: Sequence[Call], outcomes: list[Outcome | None]) -> None:
        deadlines = [w.call[1] if w.call else w.start_deadline for w in self.workers if w.call or not w.ready]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        watched = {worker.conn: worker for worker in self.workers if worker.call or not worker.ready}
        if not watched:
            return
        for conn in multiprocessing.connection.wait(list(watched), timeout=timeout):
            worker = watched[conn]
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):
                worker.process.join(_JOIN_AFTER_KILL_S)
                if not worker.ready:
                    raise WorkerStartError(
                        f"a reward worker exited during start-up (exit code {worker.process.exitcode})"
                    )
                index = worker.call[0]
                outcomes[index] = Outcome(
                    "error", 0.0, f"the reward worker process died (exit code {worker.process.exitcode})"
                )
                self._replace(worker)
                continue
            if kind == "ready":
                worker.ready = True
            elif kind == "startup_error":
                raise WorkerStartError(f"a reward worker could not load the reward functions: {payload}")
            else:
                index = worker.call[0]
                if kind == index:
                    outcomes[index] = payload
                    worker.call = None
        now = time.monotonic()
        for worker in list(self.workers):
            if worker.call and now >= worker.call[1]:
                outcomes[worker.call[0]] = Outcome(
                    "timeout", 0.0, f"no result within {worker.call[2]:g} s; the worker was killed"
                )
                self._replace(worker)
            elif not worker.ready and now >= worker.start_deadline:
                raise WorkerStartError(
                    f"a reward worker was not ready within {self.startup_timeout_s:g} s "
                    "(slow imports in the reward module, or an overloaded machine)"
                )
