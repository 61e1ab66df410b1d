"""The trainer's side of asynchronous RL (rl.max_staleness >= 1): the driver runs the producer
(async_rollout.AsyncRollout); every rank takes each step's batch from it, broadcast, or the
producer's error, so that no rank waits on a driver that stopped."""

from __future__ import annotations

import time
from typing import Callable

from megatron_rl.rollout.pool import rollout_failed
from megatron_rl.rollout.protocol import EngineError, Sample, SamplingParams
from megatron_rl.train.async_rollout import AsyncRollout, staleness
from megatron_rl.train.collect import rollout_params, step_seed
from megatron_rl.train.experience import StepRollout, Trajectory
from megatron_rl.train.scoring import assemble_step


class AsyncCollector:
    """The trainer's side of asynchronous RL, with the calls of collect.SyncCollector: the driver
    runs the producer; every rank takes each step's batch from it, broadcast."""

    def __init__(self, *, config, dynamic_sampling: bool, sampler, train_set, rollout, generation, scorer, runtime,
                 notify: Callable[[str], None]):
        self.config, self.dynamic_sampling, self.runtime, self.notify = config, dynamic_sampling, runtime, notify
        self.sampler, self.train_set, self.rollout, self.scorer = sampler, train_set, rollout, scorer
        self.generation = generation
        self.producer: AsyncRollout | None = None  # the driver's, once started
        self.started = False  # on every rank

    def start(self, next_step: int, resumed_state: dict | None) -> None:
        """The driver's producer starts generating batch `next_step` on the weights just pushed
        (version next_step - 1), from the checkpoint's unfinished business when resuming."""
        self.started = True
        if not self.runtime.is_driver:
            return
        rl, rollout = self.config.rl, self.config.rollout
        overgeneration = rollout.overgeneration_groups
        if overgeneration is None:
            overgeneration = max(1, rl.prompts_per_step // 4)
        self.producer = AsyncRollout(
            pool=self.rollout.pool, sampler=self.sampler, encode=self._encode, score_group=self._score_group,
            params=rollout_params(rl, step_seed(self.config.seed, 0, 0), partial=rollout.partial),
            wanted=rl.prompts_per_step, max_staleness=rl.max_staleness, partial=rollout.partial,
            dynamic_sampling=self.dynamic_sampling,
            max_groups=rl.prompts_per_step * (1 + rl.max_refill_rounds if self.dynamic_sampling else 1),
            overgeneration=overgeneration, timeout_s=rollout.request_timeout_s, last_step=rl.steps,
            generate_group=self._generate_group if self.generation.multi_turn else None)
        state = resumed_state.get("async_rollout") if resumed_state is not None else None
        self.producer.start(next_step, version=next_step - 1, state=state)

    def _encode(self, index: int) -> list[int]:
        return self.generation.encode(self.train_set[index].prompt)

    def _generate_group(self, index: int, params: SamplingParams, request) -> list[Sample]:
        return self.generation.group_on_driver(self.train_set[index], params, request)

    def _score_group(self, index: int, samples: list[Sample]) -> tuple[list[Trajectory], dict]:
        return self.scorer.score_group_on_driver(self.train_set[index], samples)

    def take(self, step: int, timings: dict) -> StepRollout:
        """Step `step`'s batch on every rank, with its staleness metrics."""
        tick = time.perf_counter()
        batch = self._shared(self.producer.take, step)
        timings["time/wait_rollout_s"] = time.perf_counter() - tick
        while self.producer is not None and self.producer.notices:
            self.notify(self.producer.notices.pop(0))
        ages = staleness(batch, policy_version=step - 1)
        if ages and max(ages) > self.config.rl.max_staleness:
            raise RuntimeError(f"step {step}: a sample is {max(ages)} versions stale, more than "
                               f"rl.max_staleness={self.config.rl.max_staleness} (a scheduling bug)")
        return assemble_step(batch.groups, batch.generated, batch.reward_metrics, batch.sampler_metrics,
                             {"rollout/overgenerated_groups": batch.overgenerated,
                              "rollout/staleness_mean": sum(ages) / max(len(ages), 1),
                              "rollout/staleness_max": max(ages, default=0)})

    def before_push(self, version: int | None, timings: dict | None) -> None:
        """Without partial rollouts the push waits for the batches due at older versions
        (`time/wait_push_s`); then the producer holds new requests until `after_push`."""
        if not self.started:
            return
        tick = time.perf_counter()
        self._shared(self.producer.before_push, version)
        if timings is not None:
            timings["time/wait_push_s"] = time.perf_counter() - tick

    def _shared(self, call, *args):
        """Collective: the driver's `call(*args)`, or its error raised on every rank (an engine
        error as RolloutFailed, in one line)."""
        result = None
        if self.producer is not None:
            try:
                result = call(*args)
            except Exception as exc:  # noqa: BLE001 - every rank raises it, none waits for the driver
                cause = exc.__cause__ if isinstance(exc.__cause__, EngineError) else exc  # the producer's, wrapped
                result = rollout_failed("generate", cause)
        result = self.runtime.from_driver(result)
        if isinstance(result, BaseException):
            raise result
        return result

    def pause_mode(self, version: int | None) -> str:
        """With partial rollouts a step's push aborts the requests in flight (each returns what it
        has and is continued on the new weights); the first push, and every push without partial
        rollouts, waits for them."""
        return "abort" if self.config.rollout.partial and version is not None else "wait"

    def after_push(self, version: int | None) -> None:
        if self.producer is not None:
            self.producer.pushed(version)

    def state_dict(self) -> dict:
        """The sampler runs ahead of training: a checkpoint records where the next batch to
        generate starts, and the batches generated but not yet trained on."""
        if self.producer is None:
            return {"sampler": self.sampler.state_dict()}
        return {"sampler": self.producer.sampler_state(), "async_rollout": self.producer.state_dict()}

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
