"""The Olmo 3 prompt curriculum (``data.sampler: curriculum``): a deterministic, resumable sampler
that draws prompts by their current success rate.

Each prompt keeps the outcomes (success: reward >= ``success_threshold``) of its last ``window``
samples. With at least ``min_samples`` of them its success rate puts it in one of the bands
0-10 / 10-30 / 30-70 / 70-90 / 90-100 % (lower edge inclusive; 90-100 includes 100); with fewer it
is "unseen". Per prompt status:

* active: drawable, with probability proportional to its band's weight (``band_weights``, 30-70
  the heaviest by default), without replacement within a step (a prompt drawn since the last
  ``step()`` is not drawn again by a refill);
* paused: fell into 0-10 %; comes back after ``pause_steps`` steps with an empty window (unseen);
* retired: reached 90-100 %; never drawn again (except by the exhausted-pool rule).

The exhausted-pool rule (``when_exhausted``), applied one prompt at a time when a draw finds no
active prompt left: "unpause" ends the earliest-scheduled pause first (its window emptied), then
draws retired prompts uniformly; "uniform" draws the paused and retired prompts uniformly without
ending pauses. When every prompt was already drawn in this step, the within-step exclusion is
dropped and prompts repeat. Every prompt retired thus means a uniform sampler over the dataset:
``band_metrics`` reports it as ``data/curriculum/all_retired`` and ``pop_notices()`` says it once.

Randomness: the ``k``-th ``take`` uses ``random.Random("megatron_rl.curriculum:<seed>:<k>")``
(a string seed goes through SHA-512: stable across Python versions and machines), so the state is
plain ints and strings and the same sequence of ``take`` / ``observe`` / ``step`` calls gives the
same prompts. Cost: O(num_prompts) per ``take`` (one pass over the statuses).

State (JSON-safe), saved in the trainer checkpoint::

    {"kind": "curriculum", "version": 1, "seed": 1234, "num_prompts": 8192, "draws": 57, "step": 40,
     "windows": {"17": "01101100"}, "paused": {"5": 52}, "retired": [9], "excluded": [], "drawn": {},
     "unpaused_early": 0, "fallback_draws": 0, "notified_all_retired": false}

(``windows``: outcomes oldest first, "1" a success; ``paused``: index -> the step it returns at;
``excluded`` / ``drawn``: prompts drawn since the last ``step()`` and the band each was drawn from.)
"""

from __future__ import annotations

import random
from typing import Any, Iterator, Mapping

from megatron_rl.data.config import CURRICULUM_BANDS, CurriculumConfig
from megatron_rl.errors import ConfigError

__all__ = ["CurriculumSampler", "band_of"]

_STATE_VERSION = 1
_UNSEEN, _LOWEST, _TOP = 0, 1, 5  # band codes: indices into CURRICULUM_BANDS
_EDGES_TENTHS = (1, 3, 7, 9)  # 10 %, 30 %, 70 %, 90 %, in tenths (integer arithmetic: exact edges)
_ACTIVE, _PAUSED, _RETIRED = 0, 1, 2
_SHARE_KEYS = tuple(f"data/band_share/{band}" for band in CURRICULUM_BANDS)


def band_of(successes: int, samples: int, min_samples: int = 1) -> str:
    """The band name of a prompt with ``successes`` out of ``samples`` outcomes."""
    return CURRICULUM_BANDS[_band_code(successes, samples, min_samples)]


def _band_code(successes: int, samples: int, min_samples: int) -> int:
    if samples < min_samples or samples == 0:
        return _UNSEEN
    for offset, tenths in enumerate(_EDGES_TENTHS):
        if successes * 10 < tenths * samples:
            return _LOWEST + offset
    return _TOP


class CurriculumSampler:
    def __init__(self, num_prompts: int, batch_size: int, *, seed: int, config: CurriculumConfig | None = None):
        for name, value in (("num_prompts", num_prompts), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"sampler: {name} must be an integer >= 1, got {value!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"sampler: seed must be an integer, got {seed!r}")
        config = (config or CurriculumConfig()).validate()
        self.config = config
        self.num_prompts, self.batch_size, self.seed = num_prompts, batch_size, seed
        # None: one epoch's worth of steps (the Olmo 3 recipe pauses for epochs).
        self.pause_steps = config.pause_steps if config.pause_steps is not None else -(-num_prompts // batch_size)
        self._weights = tuple(config.band_weights[band] for band in CURRICULUM_BANDS)
        self.draws = 0  # take() calls so far: the next one's RNG stream
        self.steps = 0  # step() calls so far: the clock of the pauses
        self._windows: dict[int, str] = {}
        self._band = bytearray(num_prompts)  # current band code per prompt (all unseen)
        self._status = bytearray(num_prompts)  # _ACTIVE / _PAUSED / _RETIRED
        self._paused: dict[int, int] = {}  # index -> the step it comes back at
        self._excluded: set[int] = set()  # drawn since the last step(): not drawn again
        self._drawn: dict[int, int] = {}  # index -> the band it was (last) drawn from, this step
        self._unpaused_early = 0
        self._fallback_draws = 0
        self._notified_all_retired = False
        self._notices: list[str] = []

    # ---- drawing ----------------------------------------------------------------------------

    def take(self, n: int) -> list[int]:
        """``n`` prompt indices, weighted by band, none drawn earlier in this step while any other
        prompt is left (see the module docstring for the exhausted-pool rule)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"take: n must be an integer >= 0, got {n!r}")
        if n == 0:
            return []
        rng = random.Random(f"megatron_rl.curriculum:{self.seed}:{self.draws}")
        self.draws += 1
        pools = self._pools()
        fallback: list[int] | None = None  # prompts the exhausted-pool rule draws uniformly
        early: list[int] | None = None  # paused prompts, earliest scheduled return first
        out: list[int] = []
        while len(out) < n:
            masses = [weight * len(pool) for weight, pool in zip(self._weights, pools)]
            total = sum(masses)
            if total > 0:
                point, band = rng.random() * total, None
                for code, mass in enumerate(masses):
                    if mass:
                        band = code
                        if point < mass:
                            break
                        point -= mass
                pool = pools[band]
                j = rng.randrange(len(pool))
                pool[j], pool[-1] = pool[-1], pool[j]
                index = pool.pop()
            else:
                if self.config.when_exhausted == "unpause":
                    if early is None:
                        early = sorted((i for i in self._paused if i not in self._excluded),
                                       key=lambda i: (self._paused[i], i), reverse=True)
                    if early:
                        index = early.pop()
                        self._resume(index)
                        self._unpaused_early += 1
                        pools[_UNSEEN].append(index)
                        continue
                if fallback is None:
                    fallback = [i for i in range(self.num_prompts)
                                if self._status[i] != _ACTIVE and i not in self._excluded]
                    if self._status.count(_RETIRED) == self.num_prompts and not self._notified_all_retired:
                        self._notified_all_retired = True
                        self._notices.append(
                            f"curriculum: every one of the {self.num_prompts} prompts is retired (success rate "
                            f">= 90%); from step {self.steps} prompts are drawn uniformly over the whole dataset")
                if not fallback:
                    # Every prompt was drawn in this step already: prompts repeat from here on.
                    self._excluded.clear()
                    pools, fallback, early = self._pools(), None, None
                    continue
                j = rng.randrange(len(fallback))
                fallback[j], fallback[-1] = fallback[-1], fallback[j]
                index = fallback.pop()
                band = self._band[index]
                self._fallback_draws += 1
            out.append(index)
            self._excluded.add(index)
            self._drawn[index] = band
        return out

    def _pools(self) -> list[list[int]]:
        pools: list[list[int]] = [[] for _ in CURRICULUM_BANDS]
        status, band, excluded = self._status, self._band, self._excluded
        for index in range(self.num_prompts):
            if status[index] == _ACTIVE and index not in excluded:
                pools[band[index]].append(index)
        return pools

    def next_batch(self) -> list[int]:
        return self.take(self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    # ---- feedback ---------------------------------------------------------------------------

    def observe(self, index: int, rewards: list[float]) -> None:
        """One scored group of prompt ``index`` (its G rewards): updates its window, and pauses
        (0-10 %) or retires (90-100 %) it when active."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.num_prompts:
            raise ValueError(f"observe: index must be a prompt index in [0, {self.num_prompts}), got {index!r}")
        if not rewards:
            return
        threshold = self.config.success_threshold
        outcomes = "".join("1" if float(r) >= threshold else "0" for r in rewards)  # NaN: a failure
        window = (self._windows.get(index, "") + outcomes)[-self.config.window:]
        self._windows[index] = window
        band = self._band[index] = self._code_of(window)
        if self._status[index] == _ACTIVE:
            if band == _LOWEST and self.pause_steps > 0:
                self._status[index] = _PAUSED
                self._paused[index] = self.steps + self.pause_steps
            elif band == _TOP and self.config.retire:
                self._status[index] = _RETIRED

    def step(self) -> None:
        """The end of a trainer step: the pause clock ticks (prompts whose pause is over come back,
        unseen), and the step's exclusion and counters start over. Call after the step's
        ``observe`` and ``band_metrics`` calls."""
        self.steps += 1
        for index in [i for i, until in self._paused.items() if until <= self.steps]:
            self._resume(index)
        self._excluded.clear()
        self._drawn.clear()
        self._unpaused_early = self._fallback_draws = 0

    def _resume(self, index: int) -> None:
        del self._paused[index]
        self._status[index] = _ACTIVE
        self._windows.pop(index, None)  # retried afresh: the old outcomes are an older policy's
        self._band[index] = _UNSEEN

    def _code_of(self, window: str) -> int:
        return _band_code(window.count("1"), len(window), self.config.min_samples)

    # ---- metrics ----------------------------------------------------------------------------

    def band_metrics(self, indices: list[int]) -> dict[str, float]:
        """The share of ``indices`` (one per group used in the step) in each band, by the band each
        was drawn from in this step (else its current band), plus the pool's state. Fixed keys:
        ``data/band_share/<band>`` for every band (all 0 for no indices) and ``data/curriculum/``
        ``active_prompts``, ``paused_prompts``, ``retired_prompts``, ``unpaused_early`` and
        ``fallback_draws`` (this step's exhausted-pool draws), ``all_retired`` (0 or 1)."""
        counts = [0] * len(CURRICULUM_BANDS)
        for index in indices:
            counts[self._drawn.get(index, self._band[index])] += 1
        metrics = {key: (count / len(indices) if indices else 0.0) for key, count in zip(_SHARE_KEYS, counts)}
        retired = self._status.count(_RETIRED)
        metrics.update({
            "data/curriculum/active_prompts": float(self._status.count(_ACTIVE)),
            "data/curriculum/paused_prompts": float(self._status.count(_PAUSED)),
            "data/curriculum/retired_prompts": float(retired),
            "data/curriculum/unpaused_early": float(self._unpaused_early),
            "data/curriculum/fallback_draws": float(self._fallback_draws),
            "data/curriculum/all_retired": float(retired == self.num_prompts),
        })
        return metrics

    def pop_notices(self) -> list[str]:
        """One-time messages (every prompt retired) since the last call, for the run's log."""
        notices, self._notices = self._notices, []
        return notices

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "curriculum",
            "version": _STATE_VERSION,
            "seed": self.seed,
            "num_prompts": self.num_prompts,
            "draws": self.draws,
            "step": self.steps,
            "windows": {str(i): w for i, w in sorted(self._windows.items())},
            "paused": {str(i): until for i, until in sorted(self._paused.items())},
            "retired": [i for i in range(self.num_prompts) if self._status[i] == _RETIRED],
            "excluded": sorted(self._excluded),
            "drawn": {str(i): CURRICULUM_BANDS[b] for i, b in sorted(self._drawn.items())},
            "unpaused_early": self._unpaused_early,
            "fallback_draws": self._fallback_draws,
            "notified_all_retired": self._notified_all_retired,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state from ``state_dict`` (the seed comes from the state). The settings
        (window, weights, ...) are this sampler's: a resume may change them."""
        kind = state.get("kind", "uniform")
        if kind != "curriculum":
            raise ConfigError(f"sampler state was saved by the {kind} sampler but this run has "
                              f"data.sampler=curriculum; resume with data.sampler={kind} (a different sampler "
                              "cannot continue its stream)")
        missing = [key for key in self.state_dict() if key not in state]
        if missing:
            raise ConfigError(f"sampler state is missing {', '.join(missing)}")
        if state["version"] != _STATE_VERSION:
            raise ConfigError(f"sampler state version {state['version']!r} is not supported "
                              f"(expected {_STATE_VERSION})")
        if state["num_prompts"] != self.num_prompts:
            raise ConfigError(f"sampler state was saved for {state['num_prompts']} prompts but this dataset has "
                              f"{self.num_prompts}: resuming needs the same dataset")
        try:
            ints = {key: _nonnegative(state[key], key) for key in ("draws", "step", "unpaused_early", "fallback_draws")}
            seed = state["seed"]
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise ValueError(f"seed must be an integer, got {seed!r}")
            windows = {self._index(i): str(w)[-self.config.window:] for i, w in dict(state["windows"]).items()}
            if any(set(w) - {"0", "1"} for w in windows.values()):
                raise ValueError("windows must be strings of 0 and 1")
            paused = {self._index(i): _nonnegative(until, "paused") for i, until in dict(state["paused"]).items()}
            retired = {self._index(i) for i in state["retired"]}
            excluded = {self._index(i) for i in state["excluded"]}
            drawn = {self._index(i): CURRICULUM_BANDS.index(b) for i, b in dict(state["drawn"]).items()}
            if retired & paused.keys():
                raise ValueError("a prompt is both paused and retired")
        except (TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"sampler state is not a valid curriculum state: {exc}") from None
        self.seed = seed
        self.draws, self.steps = ints["draws"], ints["step"]
        self._unpaused_early, self._fallback_draws = ints["unpaused_early"], ints["fallback_draws"]
        self._notified_all_retired = bool(state["notified_all_retired"])
        self._windows, self._paused, self._excluded, self._drawn = windows, paused, excluded, drawn
        self._status = bytearray(self.num_prompts)
        self._band = bytearray(self.num_prompts)
        for index in paused:
            self._status[index] = _PAUSED
        for index in retired:
            self._status[index] = _RETIRED
        for index, window in windows.items():
            self._band[index] = self._code_of(window)
        self._notices = []

    def _index(self, value: Any) -> int:
        """A prompt index of the state (JSON object keys are strings)."""
        index = int(value) if isinstance(value, str) else value
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.num_prompts:
            raise ValueError(f"prompt index {value!r} is not in [0, {self.num_prompts})")
        return index


def _nonnegative(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be an integer >= 0, got {value!r}")
    return value
