"""Data-parallel rollout: several engines behind the one protocol, surviving the death of some.

One call with many prompts is split into contiguous slices, one per live engine, generated
concurrently and put back in prompt order; many concurrent calls with a few prompts each (an
asynchronous producer, one call per prompt group) go each to the live engine with the fewest
prompts in flight. Because each prompt's seed is derived from (request seed, prompt index) and the
pool passes every engine the global indices, the samples do not depend on how many engines there
are or which engine generated a prompt.

An engine that dies (EngineUnavailable: process exited, connection refused or reset, retries
exhausted; or any other failure after which its health check fails too) is marked dead with an
`EngineDied`, a warning names it, and the prompts it had not returned are generated again on the
live engines with the same global indices, so with the same seeds: every prompt's group appears
exactly once. A dead engine gets no more requests, pauses or health checks (`pool.live`,
`pool.dead`); weight transports drop it on every trainer rank (rollout/weights/transport.py, `drop`).
Only when no engine is left does generate raise (EngineUnavailable naming every dead engine on
one line: a server the run started with its exit code or signal and its log). Failures that are
not deaths (a refused request: EngineError, the engine still healthy) raise as before, naming the
engine. The trainer's rollout client turns either into `RolloutFailed` on every rank at once
(`rollout_failed`): the run keeps the last finished step's checkpoint and stops in one line.

Weights reach the pool's engines through a transport (rollout/weights/transport.py), one engine at a time
or all at once, never through the pool.
"""

from __future__ import annotations

import inspect
import logging
import pickle
import signal
import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import replace

from megatron_rl.errors import TrainingStopped, raised_at
from megatron_rl.rollout.protocol import (
    PAUSE_MODES,
    EngineDied,
    EngineError,
    EngineUnavailable,
    RolloutEngine,
    Sample,
    SamplingParams,
    check_grouping,
)

logger = logging.getLogger(__name__)


class RolloutFailed(TrainingStopped):
    """The rollout engines could not generate (or take the weights): every engine died, or one
    failed a request. Raised on every trainer rank at once (rollout/client.py shares the driver's
    error); the trainer checkpoints the last finished step and stops with this one line."""


def rollout_failed(action: str, error: BaseException, *, in_process: bool = False) -> BaseException:
    """What every rank raises for `error` from the engines while they `action` ("generate"): an
    engine error (or, `in_process`, any error of an engine in this process) as RolloutFailed in one
    line; anything else as itself, in a form that crosses a broadcast."""
    if isinstance(error, TrainingStopped):  # RolloutFailed, WeightsNotServed: already a stop
        return error
    if isinstance(error, EngineError):
        return RolloutFailed(f"the rollout engines could not {action}: {_first_line(error)}")
    if in_process:
        return RolloutFailed(f"the rollout engine could not {action}: {type(error).__name__}: "
                             f"{_first_line(error)}{raised_at(error)}")
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - its type cannot be rebuilt elsewhere: its text can
        return RuntimeError(f"{type(error).__name__}: {error}{raised_at(error)}")


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


class EnginePool:
    def __init__(self, engines: list[RolloutEngine], name: str = "rollout-pool"):
        if not engines:
            raise ValueError("EnginePool needs at least one engine")
        names = [engine.name for engine in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique, got {names}")
        self.engines, self.name = list(engines), name
        self._lock = threading.Lock()
        self._in_flight = {engine.name: 0 for engine in self.engines}  # prompts sent, not yet returned
        self._dead: dict[str, EngineDied] = {}  # name -> why, in order of death

    # ---- which engines serve --------------------------------------------------------------------

    @property
    def live(self) -> list[RolloutEngine]:
        """The engines still serving, in their original order."""
        with self._lock:
            return [engine for engine in self.engines if engine.name not in self._dead]

    @property
    def dead(self) -> list[str]:
        """Names of the engines that died, in the order they died."""
        with self._lock:
            return list(self._dead)

    def cause(self, name: str) -> EngineDied:
        """Why engine `name` was marked dead."""
        with self._lock:
            return self._dead[name]

    def in_flight(self) -> dict[str, int]:
        """Prompts each engine has been sent and not yet returned (a snapshot)."""
        with self._lock:
            return dict(self._in_flight)

    # ---- generation ------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams, timeout_s: float | None = None) -> list[list[Sample]]:
        """n samples per prompt, in prompt order, from the live engines (thread-safe: concurrent
        calls share the engines by load). `timeout_s` bounds each engine request; prompts moved
        off a dead engine start again, with the same timeout, as soon as its death is known."""
        if not prompts:
            return []
        groups: list[list[Sample] | None] = [None] * len(prompts)
        failures: list[EngineError] = []
        exhausted: EngineUnavailable | None = None
        assignments = self._assign([(0, len(prompts))])
        if len(assignments) == 1:  # a small call: no thread of its own, unless an engine dies
            engine, start, stop = assignments[0]
            result = self._slice(engine, prompts, start, stop, params, timeout_s)
            if not isinstance(result, EngineError):
                check_grouping(self.name, prompts, params, result)
                return result
            if not self._died(engine, result):
                raise result
            assignments = self._moved(engine, start, stop)
        with ThreadPoolExecutor(max_workers=2 * len(self.engines)) as pool:
            running = {pool.submit(self._slice, engine, prompts, start, stop, params, timeout_s): (engine, start, stop)
                       for engine, start, stop in assignments}
            while running:
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    engine, start, stop = running.pop(future)
                    result = future.result()
                    if not isinstance(result, EngineError):
                        groups[start:stop] = result
                    elif not self._died(engine, result):
                        failures.append(result)
                    elif not failures and exhausted is None:  # after a failure nothing more starts
                        try:
                            moved = self._moved(engine, start, stop)
                        except EngineUnavailable as exc:  # no live engine left
                            exhausted = exc
                            continue
                        for target, begin, end in moved:
                            running[pool.submit(self._slice, target, prompts, begin, end, params, timeout_s)] = (
                                target, begin, end)
        if failures:
            kind = EngineUnavailable if any(isinstance(exc, EngineUnavailable) for exc in failures) else EngineError
            raise kind(f"{self.name}: {len(failures)} request{'s' if len(failures) > 1 else ''} failed:\n  "
                       + "\n  ".join(str(exc) for exc in failures))
        if exhausted is not None:
            raise exhausted
        check_grouping(self.name, prompts, params, groups)
        return groups

    def _moved(self, dead: RolloutEngine, start: int, stop: int) -> list[tuple[RolloutEngine, int, int]]:
        """The prompts a dead engine did not return, assigned to the live engines."""
        assignments = self._assign([(start, stop)])
        logger.info("%s: prompts %d..%d of dead %s moved to %s", self.name, start, stop - 1, dead.name,
                    ", ".join(f"{engine.name} ({begin}..{end - 1})" for engine, begin, end in assignments))
        return assignments

    def _assign(self, ranges: list[tuple[int, int]]) -> list[tuple[RolloutEngine, int, int]]:
        """Each range split into contiguous slices, one per live engine at most, every slice to the
        live engine with the fewest prompts in flight (ties: the lowest index). With idle engines
        and one range this is slice i -> live engine i, deterministic given the live set. The
        slices are counted in flight here, under the lock, so concurrent calls spread out."""
        with self._lock:
            live = [engine for engine in self.engines if engine.name not in self._dead]
            if not live:
                raise self._none_left()
            assignments = []
            for begin, end in ranges:
                for start, stop in _split(end - begin, min(end - begin, len(live))):
                    engine = min(live, key=lambda e: self._in_flight[e.name])  # first minimum: lowest index
                    self._in_flight[engine.name] += stop - start
                    assignments.append((engine, begin + start, begin + stop))
            return assignments

    def _slice(self, engine, prompts, start, stop, params, timeout_s) -> list[list[Sample]] | EngineError:
        """prompts[start:stop] on `engine` (counted in flight by _assign), or the EngineError it raised."""
        try:
            return _generate_slice(engine, prompts, start, stop, params, timeout_s)
        except EngineError as exc:
            return exc
        finally:
            with self._lock:
                self._in_flight[engine.name] -= stop - start

    # ---- deaths ----------------------------------------------------------------------------------

    def _died(self, engine: RolloutEngine, error: EngineError) -> bool:
        """Whether `error` means the engine is dead; if so it is marked dead. EngineUnavailable is a
        death; after any other engine error the engine is dead only if its health check fails."""
        if not isinstance(error, EngineUnavailable):
            try:
                engine.health()
                return False
            except EngineError as probe:
                error = EngineUnavailable(f"{error}; then its health check failed: {probe}")
        self._mark_dead(engine, error)
        return True

    def _mark_dead(self, engine: RolloutEngine, error: EngineError) -> None:
        with self._lock:
            if engine.name in self._dead:
                return
            self._dead[engine.name] = error if isinstance(error, EngineDied) else EngineDied(str(error))
            left = [e.name for e in self.engines if e.name not in self._dead]
        logger.warning("%s: engine %s died (EngineDied: %s); its unfinished prompts go to the live engines %s",
                       self.name, engine.name, error, left)

    def _none_left(self) -> EngineUnavailable:
        """One line naming every dead engine and why (called with the lock held)."""
        engines = {engine.name: engine for engine in self.engines}
        return EngineUnavailable(f"{self.name}: no live engine left; dead: "
                                 + "; ".join(_why_dead(engines[name], cause) for name, cause in self._dead.items()))

    # ---- lifecycle -------------------------------------------------------------------------------

    def pause(self, mode: str = "wait") -> None:
        """Hold generation on every live engine around a weight sync. vLLM's modes: "wait"
        (in-flight requests finish first), "abort" (they return aborted), "keep" (they are frozen
        and continue after resume). Engines whose `pause` takes no mode support "wait" only."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        if mode == "wait":
            self._each("pause")
            return
        for engine in self.live:
            if "mode" not in inspect.signature(engine.pause).parameters:
                raise EngineError(f"{engine.name}: pause(mode={mode!r}) is not supported (only 'wait')")
        self._each("pause", mode=mode)

    def resume(self) -> None:
        self._each("resume")

    def health(self) -> None:
        """Return if some engine serves; engines failing their check are marked dead."""
        self._each("health")

    def reset_prefix_cache(self) -> None:
        self._each("reset_prefix_cache")

    def shutdown(self) -> None:
        """Every engine, the dead ones included (their processes may still hold resources)."""
        errors = []
        for engine in self.engines:
            try:
                engine.shutdown()
            except Exception as exc:  # shut the others down regardless
                errors.append(f"{engine.name}: {exc}")
        if errors:
            raise EngineError(f"{self.name}: shutdown errors: " + "; ".join(errors))

    def _each(self, method: str, **kwargs) -> None:
        """`engine.method(**kwargs)` on every live engine in order. An engine that is unavailable
        (or fails and then fails its health check) is marked dead and skipped; other failures are
        raised together; with no engine left, EngineUnavailable names every dead one."""
        failures = []
        for engine in self.live:
            try:
                getattr(engine, method)(**kwargs)
            except EngineError as exc:
                if not self._died(engine, exc):
                    failures.append(exc)
        if failures:
            raise EngineError(f"{self.name}: {method} failed on " + "; ".join(str(exc) for exc in failures))
        with self._lock:
            if len(self._dead) == len(self.engines):
                raise self._none_left()


def _why_dead(engine: RolloutEngine, cause: EngineError) -> str:
    """'name: why' on one line: a server process that exited by its code (and signal) and its log,
    else the first line of the error that marked the engine dead."""
    server = getattr(engine, "process", None)  # a server this run started (rollout/engines/server_process.py)
    process = getattr(server, "process", None)
    code = process.poll() if process is not None else None
    if code is not None:
        try:
            killed = f" (killed by {signal.Signals(-code).name})" if code < 0 else ""
        except ValueError:
            killed = ""
        return f"{engine.name}: server process exited with code {code}{killed}; its log: {server.log_path}"
    line = _first_line(cause)
    return line if line.startswith(f"{engine.name}:") else f"{engine.name}: {line}"


def _split(count: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for part in range(parts):
        stop = start + base + (1 if part < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _generate_slice(engine, prompts, start, stop, params: SamplingParams, timeout_s):
    """Generate prompts[start:stop] with the seeds of their global indices, renumbered to global indices."""
    groups = engine.generate(prompts[start:stop], params.offset(start), timeout_s)
    return [[replace(sample, prompt_index=start + local) for sample in group] for local, group in enumerate(groups)]
