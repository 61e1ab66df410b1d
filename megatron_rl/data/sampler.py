"""A deterministic, resumable stream of prompt indices.

The stream is the concatenation of one permutation of ``range(num_prompts)`` per epoch; epoch
``e``'s permutation is a pure function of (seed, e). ``take(n)`` returns the next ``n`` indices
and advances the cursor by exactly ``n``, crossing into the next epoch when needed, so

* ``next_batch()`` is ``take(batch_size)``;
* dynamic sampling draws extra prompts with ``take(k)`` (oversampling to refill a batch whose
  groups were filtered out) without skipping or repeating anything in the stream;
* ``state_dict()`` is just (seed, epoch, position) plus what must match on restore, and a
  sampler restored from it yields exactly the indices the original would have yielded next.

A draw that crosses an epoch boundary can hold the same prompt twice (once from each epoch);
with batches much smaller than the dataset this is rare and harmless.

The state is plain ints and bools (JSON-safe), meant to be saved inside the trainer checkpoint:

    {"version": 1, "seed": 1234, "epoch": 3, "position": 96, "num_prompts": 8192, "shuffle": true}

Restoring checks ``num_prompts`` and ``shuffle`` against this sampler (another dataset would make
the position meaningless) and takes ``seed`` from the state: an exact continuation is the point.

``build_sampler(data_config, num_prompts, batch_size, seed)`` picks the sampler of
``data.sampler``: this one ("uniform") or the success-rate curriculum (megatron_rl/data/curriculum.py).
Both answer the same calls: ``take`` / ``next_batch``, ``observe(index, rewards)`` after each scored
group, ``band_metrics(indices)``, ``step()`` at the end of a trainer step, ``pop_notices()``,
``state_dict`` / ``load_state_dict``; for this sampler the feedback calls do nothing.
"""

from __future__ import annotations

import random
from typing import Any, Iterator, Mapping

from megatron_rl.errors import ConfigError

__all__ = ["PromptSampler", "build_sampler"]

_STATE_VERSION = 1


class PromptSampler:
    def __init__(self, num_prompts: int, batch_size: int, *, seed: int, shuffle: bool = True):
        for name, value in (("num_prompts", num_prompts), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"sampler: {name} must be an integer >= 1, got {value!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"sampler: seed must be an integer, got {seed!r}")
        self.num_prompts = num_prompts
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # index of the next prompt within this epoch's order
        self._order: list[int] | None = None  # this epoch's permutation, built on first use

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            order = list(range(self.num_prompts))
            if self.shuffle:
                # A string seed goes through SHA-512 in random.seed, so orders are stable across
                # Python versions and platforms (a resumed run may use another machine).
                random.Random(f"megatron_rl.sampler:{self.seed}:{self.epoch}").shuffle(order)
            self._order = order
        return self._order

    def take(self, n: int) -> list[int]:
        """The next ``n`` prompt indices of the stream (advances the cursor by exactly ``n``)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"take: n must be an integer >= 0, got {n!r}")
        out: list[int] = []
        while len(out) < n:
            order = self._epoch_order()
            step = min(n - len(out), self.num_prompts - self.position)
            out.extend(order[self.position : self.position + step])
            self.position += step
            if self.position == self.num_prompts:
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
        return out

    def next_batch(self) -> list[int]:
        return self.take(self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        """Endless batches (epochs follow each other); stop with the training loop."""
        while True:
            yield self.next_batch()

    # The curriculum sampler's feedback calls: the uniform stream does not depend on rewards.
    def observe(self, index: int, rewards: list[float]) -> None:
        pass

    def step(self) -> None:
        pass

    def band_metrics(self, indices: list[int]) -> dict[str, float]:
        return {}

    def pop_notices(self) -> list[str]:
        return []

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "num_prompts": self.num_prompts,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        kind = state.get("kind", "uniform")  # the uniform state has no "kind" (older checkpoints neither)
        if kind != "uniform":
            raise ConfigError(f"sampler state was saved by the {kind} sampler but this run has data.sampler=uniform; "
                              f"resume with data.sampler={kind} (a different sampler cannot continue its stream)")
        missing = [key for key in self.state_dict() if key not in state]
        if missing:
            raise ConfigError(f"sampler state is missing {', '.join(missing)}")
        if state["version"] != _STATE_VERSION:
            raise ConfigError(
                f"sampler state version {state['version']!r} is not supported (expected {_STATE_VERSION})"
            )
        if state["num_prompts"] != self.num_prompts:
            raise ConfigError(
                f"sampler state was saved for {state['num_prompts']} prompts but this dataset has "
                f"{self.num_prompts}: resuming needs the same dataset"
            )
        if state["shuffle"] != self.shuffle:
            raise ConfigError(
                f"sampler state has shuffle={state['shuffle']} but this sampler has shuffle={self.shuffle}"
            )
        for key in ("seed", "epoch", "position"):
            if isinstance(state[key], bool) or not isinstance(state[key], int):
                raise ConfigError(f"sampler state {key} must be an integer, got {state[key]!r}")
        if not (state["epoch"] >= 0 and 0 <= state["position"] < self.num_prompts):
            raise ConfigError(f"sampler state epoch={state['epoch']} position={state['position']} is out of range")
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = None


def build_sampler(data_config, num_prompts: int, batch_size: int, seed: int):
    """The sampler ``data.sampler`` names, for ``num_prompts`` prompts and ``batch_size`` prompts
    per step. ``seed``: the run's seed (``data.seed`` wins when set)."""
    if data_config.seed is not None:
        seed = data_config.seed
    if data_config.sampler == "curriculum":
        from megatron_rl.data.curriculum import CurriculumSampler

        return CurriculumSampler(num_prompts, batch_size, seed=seed, config=data_config.curriculum)
    if data_config.sampler != "uniform":
        raise ConfigError(f"data.sampler must be one of uniform, curriculum, got {data_config.sampler!r}")
    return PromptSampler(num_prompts, batch_size, seed=seed, shuffle=data_config.shuffle)
