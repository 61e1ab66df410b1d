"""Data-parallel rollout: several engines behind the one protocol.

Prompts are split into contiguous slices, one per engine, generated concurrently and put back in
prompt order. Because each prompt's seed is derived from (request seed, prompt index) and the
pool passes every engine the global indices, the samples do not depend on how many engines there
are. An engine that fails is reported by name; the pool does not silently drop its prompts.
Weights reach the pool's engines through a transport (rollout/transport.py), one engine at a time
or all at once, never through the pool.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from megatron_rl.rollout.protocol import (
    EngineError,
    EngineUnavailable,
    RolloutEngine,
    Sample,
    SamplingParams,
    check_grouping,
)


class EnginePool:
    def __init__(self, engines: list[RolloutEngine], name: str = "rollout-pool"):
        if not engines:
            raise ValueError("EnginePool needs at least one engine")
        names = [engine.name for engine in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique, got {names}")
        self.engines, self.name = list(engines), name

    def generate(self, prompts: list[list[int]], params: SamplingParams, timeout_s: float | None = None) -> list[list[Sample]]:
        slices = _split(len(prompts), len(self.engines))
        with ThreadPoolExecutor(max_workers=len(self.engines)) as pool:
            futures = [
                (engine, start, pool.submit(_generate_slice, engine, prompts, start, stop, params, timeout_s))
                for engine, (start, stop) in zip(self.engines, slices) if stop > start
            ]
            groups: list[list[Sample]] = []
            failures = []
            for engine, start, future in futures:
                try:
                    groups.extend(future.result())
                except EngineError as exc:
                    failures.append(exc)
        if failures:
            dead = [str(exc) for exc in failures]
            kind = EngineUnavailable if any(isinstance(exc, EngineUnavailable) for exc in failures) else EngineError
            raise kind(f"{self.name}: {len(failures)} of {len(self.engines)} engines failed:\n  " + "\n  ".join(dead))
        check_grouping(self.name, prompts, params, groups)
        return groups

    def pause(self) -> None:
        self._each("pause")

    def resume(self) -> None:
        self._each("resume")

    def health(self) -> None:
        self._each("health")

    def shutdown(self) -> None:
        errors = []
        for engine in self.engines:
            try:
                engine.shutdown()
            except Exception as exc:  # shut the others down regardless
                errors.append(f"{engine.name}: {exc}")
        if errors:
            raise EngineError(f"{self.name}: shutdown errors: " + "; ".join(errors))

    def _each(self, method: str) -> None:
        failures = []
        for engine in self.engines:
            try:
                getattr(engine, method)()
            except EngineError as exc:
                failures.append(exc)
        if failures:
            kind = EngineUnavailable if any(isinstance(exc, EngineUnavailable) for exc in failures) else EngineError
            raise kind(f"{self.name}: {method} failed on " + "; ".join(str(exc) for exc in failures))


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
