"""What a step trains on, from the synchronous loop: generate, score, keep, refill.

Both collectors (this one, and `async_collector.AsyncCollector` for rl.max_staleness >= 1) give
the trainer the same calls, so its loop does not branch on the mode:

    collector.start(next_step, resumed_state)   # after the first weight push
    rollout = collector.take(step, timings)     # StepRollout: the kept groups and their metrics
    collector.before_push(version, timings)     # around each weight push,
    collector.pause_mode(version)               # how the engines stop for it,
    collector.after_push(version)
    collector.state_dict()                      # what a checkpoint records (the sampler's cursor, ...)
    collector.close()

The sampling parameters of every request a run sends are made here (`rollout_params`,
`eval_params`), and so is each request's seed (`step_seed`): a resumed run regenerates the same
samples.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from megatron_rl.rollout.protocol import SamplingParams
from megatron_rl.train.experience import StepRollout
from megatron_rl.train.scoring import GroupScorer, assemble_step, combine_rounds, keeps_group, to_trajectories


def step_seed(seed: int, step: int, round_: int) -> int:
    """The engine's sampling seed for a step's generate round (-1: the held-out evaluation)."""
    return (seed * 1_000_003 + step * 101 + round_) & 0x7FFF_FFFF


def rollout_params(rl, seed: int, *, partial: bool = False) -> SamplingParams:
    """G samples per prompt for training (`rl`: the RLConfig), with the engine's MoE routes when
    R3 replays them; `partial`: the engines may abort and the caller continues (async)."""
    return SamplingParams(n=rl.group_size, temperature=rl.temperature, top_p=rl.top_p,
                          max_tokens=rl.max_response_tokens, seed=seed,
                          return_routed_experts=rl.routing_replay == "rollout", partial=partial)


def eval_params(rl, seed: int) -> SamplingParams:
    """One sample per held-out prompt, at the evaluation temperature (greedy by default)."""
    return SamplingParams(n=1, temperature=rl.eval_temperature, max_tokens=rl.max_response_tokens,
                          seed=step_seed(seed, -1, 0))


class SyncCollector:
    """G samples for each of prompts_per_step prompts; with dynamic sampling, groups whose rewards
    are all equal (no learning signal) are dropped and refilled from further prompts, at most
    max_refill_rounds extra rounds. Every rank runs it (the engines answer every rank alike)."""

    def __init__(self, *, config, dynamic_sampling: bool, sampler, train_set, rollout, generation, scorer: GroupScorer,
                 runtime, notify: Callable[[str], None]):
        """`generation`: records -> samples (train/generation.py, single- or multi-turn);
        `notify(text)`: a line for the console (the sampler's notices). Every rank holds one
        (`rollout` unused here)."""
        self.rl, self.seed, self.dynamic_sampling = config.rl, config.seed, dynamic_sampling
        self.runtime = runtime
        self.sampler, self.train_set, self.generation, self.scorer = sampler, train_set, generation, scorer
        self.notify = notify
        self.score_chunks = config.rollout.score_chunks
        # the driver's scorer thread: a request's rewards are computed while the next generates
        self._scoring = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scoring")

    def start(self, next_step: int, resumed_state: dict | None) -> None:
        """Nothing runs ahead of the trainer."""

    def take(self, step: int, timings: dict) -> StepRollout:
        wanted = self.rl.prompts_per_step
        kept, kept_prompts, generated, reward_rounds, rounds = [], [], [], [], 0
        timings["time/generate_s"] = timings["time/score_s"] = 0.0
        env_before = self.generation.env_seconds
        indices = self.sampler.next_batch()
        while True:
            records = self.train_set.select(indices)
            params = rollout_params(self.rl, step_seed(self.seed, step, rounds))
            scored, reward_metrics = self._generate_and_score(records, params, timings)
            reward_rounds.append((sum(len(g) for g in scored), reward_metrics))
            generated.extend(scored)
            for index, group in zip(indices, scored):
                self.sampler.observe(index, [t.reward for t in group])
                if keeps_group(group, self.dynamic_sampling):
                    kept.append(group)
                    kept_prompts.append(index)
            if len(kept) >= wanted or not self.dynamic_sampling or rounds >= self.rl.max_refill_rounds:
                break
            rounds += 1
            indices = self.sampler.take(wanted - len(kept))
        if self.generation.multi_turn:
            # environments ran inside generation (the driver's wall clock): their own phase
            env = self.runtime.from_driver(self.generation.env_seconds - env_before)
            timings["time/env_s"] = env
            timings["time/generate_s"] -= env
        kept, kept_prompts = kept[:wanted], kept_prompts[:wanted]
        # The sampler's metrics for the groups trained on (curriculum band shares), then its step
        # boundary (a curriculum's pause clock).
        sampler_metrics = self.sampler.band_metrics(kept_prompts)
        for notice in self.sampler.pop_notices():
            self.notify(notice)
        self.sampler.step()
        return assemble_step(kept, generated, reward_rounds, sampler_metrics, {"rollout/refill_rounds": rounds})

    def _generate_and_score(self, records, params, timings: dict):
        """One round's groups, scored. With rollout.score_chunks > 1 the round goes out as that
        many requests of whole groups (each keeps its prompts' seeds: params.offset), and the
        driver scores each in a thread while the next generates; `time/score_s` is then only the
        scoring left after the last request."""
        bounds = chunk_bounds(len(records), self.score_chunks)
        pending = []  # (samples, the driver's scoring future) per request
        tick = time.perf_counter()
        for start, end in bounds:
            chunk = [records[i] for i in range(start, end)]
            samples = self.generation.groups(chunk, params.offset(start))
            future = self._scoring.submit(self.scorer.score_on_driver, chunk, samples) if self.runtime.is_driver \
                else None
            pending.append((samples, future))
        timings["time/generate_s"] += time.perf_counter() - tick
        tick = time.perf_counter()
        scored, metric_rounds = [], []
        for samples, future in pending:
            rewards, metrics = self.runtime.from_driver(future.result() if future is not None else None)
            scored.extend(to_trajectories(samples, rewards))
            metric_rounds.append((sum(len(group) for group in samples), metrics))
        timings["time/score_s"] += time.perf_counter() - tick
        return scored, combine_rounds(metric_rounds)

    def before_push(self, version: int | None, timings: dict | None) -> None:
        """Nothing is in flight between steps."""

    def pause_mode(self, version: int | None) -> str:
        """How the engines stop for a push: nothing is in flight, so they simply wait."""
        return "wait"

    def after_push(self, version: int | None) -> None:
        pass

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict()}

    def close(self) -> None:
        self._scoring.shutdown(wait=False, cancel_futures=True)


def chunk_bounds(count: int, chunks: int) -> list[tuple[int, int]]:
    """[start, end) of `chunks` near-equal consecutive slices of `count` items (none empty)."""
    chunks = max(1, min(chunks, count))
    edges = [count * k // chunks for k in range(chunks + 1)]
    return list(zip(edges[:-1], edges[1:]))
