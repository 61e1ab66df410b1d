"""The asynchronous producer's schedule (megatron_rl/train/async_rollout.py), against a MOCK engine pool.

The mock stands in for the servers so the schedule can be driven with random latencies in a
few seconds: its samples are a pure function of (request seed, prompt, weight version), its
requests sleep a random time, and it counts how many are in flight. The real engines are in
tests/train/test_async_rl.py (vLLM server, exact resume) and tests/rollout/test_partial_rollout.py.

Checked: batch s comes from exactly version max(0, s - 1 - k) whatever the latencies; with
dynamic sampling the batch holds the first useful groups of the prompt stream, at most
`wanted + overgeneration` groups are ever in flight, the unused ones go back to the stream; a
producer restored from `state_dict` continues with exactly the same batches.
"""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

from megatron_rl.train.async_rollout import AsyncRollout, staleness
from megatron_rl.data import PromptSampler
from megatron_rl.rollout.protocol import Sample, SamplingParams
from megatron_rl.train.scoring import to_trajectories

WANTED, OVER, K, STEPS, PROMPTS = 4, 2, 2, 6, 40


class MockPool:
    """Samples determined by (seed, prompt, version); random latency; counts requests in flight."""

    def __init__(self, latency_seed: int):
        self.version = 0
        self.random = random.Random(latency_seed)
        self.lock = threading.Lock()
        self.in_flight = self.most_in_flight = 0

    def generate(self, prompts, params, timeout_s=None):
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            delay = self.random.uniform(0, 0.01)
            version = self.version
        time.sleep(delay)
        seed = params.prompt_seed(0)
        group = [Sample(0, i, prompts[0], [seed % 97, i, version], [-0.5, -0.25, -0.125], "stop")
                 for i in range(params.n)]
        with self.lock:
            self.in_flight -= 1
        return [group]


def reward(prompt: int, sample: int) -> float:
    # Every third prompt has no spread (all correct): dynamic sampling drops it.
    return 1.0 if prompt % 3 == 0 else float(sample % 2)


def producer(pool: MockPool) -> AsyncRollout:
    def score_group(prompt, samples):
        return to_trajectories([samples], [reward(prompt, s.sample_index) for s in samples])[0], {}

    return AsyncRollout(pool=pool, sampler=PromptSampler(PROMPTS, WANTED, seed=5), encode=lambda i: [1, i],
                        score_group=score_group, params=SamplingParams(n=2, max_tokens=3, seed=11), wanted=WANTED,
                        max_staleness=K, partial=False, dynamic_sampling=True, max_groups=4 * WANTED,
                        overgeneration=OVER, timeout_s=10, last_step=STEPS)


def train(rollout: AsyncRollout, pool: MockPool, first: int, stop_after: int | None = None):
    """The trainer's side: take each batch, then push the next version."""
    batches, state = {}, None
    for step in range(first, STEPS + 1):
        batches[step] = rollout.take(step)
        rollout.before_push(step)
        pool.version = step  # the push
        rollout.pushed(step)
        if step == stop_after:
            state = rollout.state_dict()
            break
    rollout.close()
    return batches, state


def content(batch):
    return [[(t.prompt_ids, t.response_ids, t.reward, t.versions) for t in group] for group in batch.groups]


@pytest.mark.parametrize("latency_seed", [0, 1])
def test_schedule_with_mock_engines_is_exact_and_bounded(latency_seed):
    pool = MockPool(latency_seed)
    rollout = producer(pool)
    rollout.start(1, version=0)
    batches, _ = train(rollout, pool, 1)
    for step, batch in batches.items():
        assert len(batch.groups) == WANTED
        assert all(len({t.reward for t in g}) > 1 for g in batch.groups)  # zero-spread groups dropped
        assert staleness(batch, step - 1) == [min(step - 1, K)] * (2 * WANTED)
        assert {v for g in batch.groups for t in g for v in t.versions} == {max(0, step - 1 - K)}
        assert batch.overgenerated <= OVER
    assert pool.most_in_flight <= WANTED + OVER

    # The same run with other latencies: the same batches (prompts, tokens, versions).
    other_pool = MockPool(latency_seed + 10)
    other = producer(other_pool)
    other.start(1, version=0)
    again, _ = train(other, other_pool, 1)
    assert all(content(again[s]) == content(batches[s]) for s in batches)
    # Every prompt of the stream is scored once, in order, until the batches are complete.
    scored = [p for s in sorted(batches) for p in batches[s].prompts]
    stream = PromptSampler(PROMPTS, WANTED, seed=5).take(len(scored))
    assert scored == stream


def test_producer_restored_from_its_state_continues_with_the_same_batches():
    pool = MockPool(3)
    rollout = producer(pool)
    rollout.start(1, version=0)
    reference, _ = train(rollout, pool, 1)

    pool = MockPool(4)
    first = producer(pool)
    first.start(1, version=0)
    _, state = train(first, pool, 1, stop_after=2)
    state = json.loads(json.dumps(state))  # as a checkpoint stores it
    assert sorted(state["ready"]) == ["3", "4"]  # generated from versions 0 and 1, not yet trained on

    pool = MockPool(5)
    pool.version = 2  # the checkpoint's weights, pushed at the resume
    resumed = producer(pool)
    resumed.start(3, version=2, state=state)
    after, _ = train(resumed, pool, 3)
    assert all(content(after[s]) == content(reference[s]) for s in range(3, STEPS + 1))
