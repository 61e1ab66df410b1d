"""The prompt sampler: per-epoch shuffles, exact resume, and oversampling with take()."""

from __future__ import annotations

import json

import pytest

from megatron_rl.errors import ConfigError
from megatron_rl.data.sampler import PromptSampler


def draw(sampler, batches):
    return [sampler.next_batch() for _ in range(batches)]


@pytest.mark.parametrize("k, m", [(0, 5), (3, 7), (9, 4), (10, 10)])
def test_restored_sampler_continues_exactly(k, m):
    original = PromptSampler(23, 5, seed=7)
    draw(original, k)
    state = json.loads(json.dumps(original.state_dict()))  # survives a JSON checkpoint
    expected = draw(original, m)
    restored = PromptSampler(23, 5, seed=7)
    restored.load_state_dict(state)
    assert draw(restored, m) == expected


def test_state_seed_wins_over_the_constructor_seed():
    original = PromptSampler(50, 4, seed=1)
    draw(original, 3)
    state = original.state_dict()
    expected = draw(original, 20)
    restored = PromptSampler(50, 4, seed=999)
    restored.load_state_dict(state)
    assert draw(restored, 20) == expected


def test_take_more_keeps_the_cursor_exact():
    # Dynamic sampling: a batch, then extra prompts; the stream is the same as plain batches.
    reference = PromptSampler(30, 4, seed=3).take(4 * 20)
    sampler = PromptSampler(30, 4, seed=3)
    drawn = []
    for extra in [0, 3, 0, 1, 7, 0, 2]:
        drawn += sampler.next_batch()
        drawn += sampler.take(extra)
    assert drawn == reference[: len(drawn)]
    state = sampler.state_dict()
    assert (state["epoch"], state["position"]) == divmod(len(drawn), 30)
    restored = PromptSampler(30, 4, seed=3)
    restored.load_state_dict(state)
    assert restored.take(9) == reference[len(drawn) : len(drawn) + 9]


def test_each_epoch_is_a_new_permutation_of_every_prompt():
    sampler = PromptSampler(40, 8, seed=0)
    epochs = [sampler.take(40) for _ in range(3)]
    assert all(sorted(epoch) == list(range(40)) for epoch in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert sampler.state_dict()["epoch"] == 3 and sampler.state_dict()["position"] == 0


def test_batches_cross_epoch_boundaries():
    sampler = PromptSampler(10, 4, seed=0)
    stream = sampler.take(40)
    other = PromptSampler(10, 4, seed=0)
    assert sum(draw(other, 10), []) == stream
    assert sampler.epoch == 4


def test_determinism_and_seed_dependence():
    assert draw(PromptSampler(100, 10, seed=5), 3) == draw(PromptSampler(100, 10, seed=5), 3)
    assert draw(PromptSampler(100, 10, seed=5), 3) != draw(PromptSampler(100, 10, seed=6), 3)


def test_unshuffled_order_and_iteration():
    sampler = PromptSampler(5, 2, seed=0, shuffle=False)
    batches = iter(sampler)
    assert [next(batches) for _ in range(3)] == [[0, 1], [2, 3], [4, 0]]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_prompts": 24}, "saved for 24 prompts but this dataset has 23"),
        ({"shuffle": False}, "shuffle=False"),
        ({"version": 2}, "version 2 is not supported"),
        ({"position": 23}, "out of range"),
        ({"epoch": "1"}, "epoch must be an integer"),
    ],
)
def test_load_state_errors(change, message):
    sampler = PromptSampler(23, 5, seed=7)
    with pytest.raises(ConfigError, match=message):
        sampler.load_state_dict({**sampler.state_dict(), **change})
    state = sampler.state_dict()
    del state["seed"]
    with pytest.raises(ConfigError, match="missing seed"):
        sampler.load_state_dict(state)


def test_constructor_errors():
    with pytest.raises(ConfigError, match="num_prompts"):
        PromptSampler(0, 1, seed=0)
    with pytest.raises(ConfigError, match="batch_size"):
        PromptSampler(3, 0, seed=0)
    with pytest.raises(ValueError, match="n must be"):
        PromptSampler(3, 1, seed=0).take(-1)
