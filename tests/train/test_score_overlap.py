"""Scoring beside generation in the synchronous loop (`rollout.score_chunks`, train/collect.py).

The engine here is a scripted stand-in (mock: what is tested is the collector's order of work,
not sampling; the real engine runs in test_train_loop.py): it answers each prompt with a digit
string derived from the prompt's seed, and records when each request started and returned. The
rewards are the real synthetic verifier in the real reward worker processes, scored by the real
GroupScorer. With 3 chunks the collector must (1) give exactly the trajectories, rewards and
reward metrics of one request, and (2) score a chunk while the next one generates."""

from __future__ import annotations

import time
from types import SimpleNamespace

from megatron_rl.config.loader import load_config
from megatron_rl.data import build_char_tokenizer
from megatron_rl.data.prompts import load_datasets
from megatron_rl.data.sampler import PromptSampler
from megatron_rl.rollout.protocol import Sample
from megatron_rl.train.collect import SyncCollector, chunk_bounds
from megatron_rl.train.scoring import GroupScorer

TOKENIZER = build_char_tokenizer()


class ScriptedGeneration:
    multi_turn, env_seconds = False, 0.0

    def __init__(self, events: list):
        self.events = events

    def groups(self, records, params):
        self.events.append(("generate", len(records), time.monotonic()))
        time.sleep(0.3)  # long enough for the previous chunk's scoring to start meanwhile
        groups = []
        for index, record in enumerate(records):
            group = []
            for sample in range(params.n):
                seed = params.prompt_seed(index)
                text = str((seed + sample) % 3) if sample % 2 else record.answer  # some right, some wrong
                ids = TOKENIZER(text, add_special_tokens=False)["input_ids"] + [TOKENIZER.eos_token_id]
                group.append(Sample(index, sample, [1, 2, 3], ids, [-0.5] * len(ids), "stop"))
            groups.append(group)
        self.events.append(("generated", len(records), time.monotonic()))
        return groups


class RecordingScorer(GroupScorer):
    def __init__(self, events, *args):
        super().__init__(*args)
        self.events = events

    def score_on_driver(self, records, groups):
        self.events.append(("score", len(records), time.monotonic()))
        return super().score_on_driver(records, groups)


def collect(chunks: int):
    config = load_config(None, ["rl.prompts_per_step=6", "rl.group_size=4", "rl.recipe=dr_grpo",
                                f"rollout.score_chunks={chunks}"])
    train_set, _ = load_datasets(config.data)
    runtime = SimpleNamespace(is_driver=True, from_driver=lambda value: value)
    events: list = []
    scorer = RecordingScorer(events, config.rewards, TOKENIZER, runtime)
    collector = SyncCollector(config=config, dynamic_sampling=False, sampler=PromptSampler(len(train_set), 6, seed=1),
                              train_set=train_set, rollout=None, generation=ScriptedGeneration(events), scorer=scorer,
                              runtime=runtime, notify=lambda text: None)
    try:
        rollout = collector.take(1, {})
    finally:
        collector.close()
        scorer.close()
    return rollout, events


def test_chunked_scoring_gives_the_same_step_and_scores_beside_generation():
    whole, _ = collect(1)
    chunked, events = collect(3)
    flat = lambda rollout: [(t.prompt_ids, t.response_ids, t.reward) for g in rollout.groups for t in g]  # noqa: E731
    assert flat(chunked) == flat(whole)
    rewards = [t.reward for g in whole.groups for t in g]
    assert 0 < sum(rewards) < len(rewards)  # right and wrong answers: the comparison means something
    for key in ("reward/mean", "reward/calls", "train/accuracy", "reward/synthetic/mean"):
        assert abs(chunked.metrics[key] - whole.metrics[key]) < 1e-12, key
    # order of work: chunk k was being scored before chunk k+1's generation returned
    starts = [at for kind, _, at in events if kind == "score"]
    returns = [at for kind, _, at in events if kind == "generated"]
    assert [n for kind, n, _ in events if kind == "generate"] == [2, 2, 2]
    assert starts[0] < returns[1] and starts[1] < returns[2]


def test_chunk_bounds_cover_every_group_once():
    assert chunk_bounds(6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert chunk_bounds(5, 2) == [(0, 2), (2, 5)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2)]
    assert chunk_bounds(7, 1) == [(0, 7)]
