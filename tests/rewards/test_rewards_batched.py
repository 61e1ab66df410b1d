"""Batched reward functions: detection, equivalence with per-sample scoring, chunking over the
workers, and isolation (a failing call scores every one of its samples 0 and counts each)."""

from __future__ import annotations

import math

import pytest

from megatron_rl.errors import ConfigError
from megatron_rl.rewards import batched, is_batched
from megatron_rl.rewards.config import RewardConfig, build_scorer
from megatron_rl.rewards.functions import as_batch_rewards, RewardValueError
from megatron_rl.rewards.registry import resolve_reward
from megatron_rl.rewards.scoring import RewardInput, RewardScorer, RewardTerm, _batch_call, _chunks

TIMEOUT_S = 0.5
FIXTURES = "batched_reward_fixtures"


def samples(*responses, answer="ab", **metadata):
    return [RewardInput("q", response, answer, metadata) for response in responses]


def graded_samples():
    # Metadata differ per sample, and one sample lacks "level": its column value is None.
    responses = ["ab", "abc", "", "ab", "x", "abcd", "ab"]
    out = [RewardInput(f"q{i}", r, "ab", {"level": i} if i != 2 else {}) for i, r in enumerate(responses)]
    return out


# --------------------------------------------------------------------------- detection


def test_detection_rule():
    def per_sample(prompt, response, answer, **metadata):
        return 1.0

    def by_name(prompts, responses, answers, **columns):
        return [1.0] * len(prompts)

    @batched
    def by_marker(a, b, c, **columns):
        return [1.0] * len(a)

    class Judge:
        @batched
        def score(self, a, b, c, **columns):
            return [0.5] * len(a)

        def __call__(self, prompts, responses, answers, **columns):
            return [0.5] * len(prompts)

    assert not is_batched(per_sample) and is_batched(by_name) and is_batched(by_marker)
    assert is_batched(Judge().score) and is_batched(Judge())  # marker through a method; name through __call__
    assert not is_batched(len)  # a builtin: its signature says per-sample
    assert resolve_reward(f"{FIXTURES}:graded_batch").batched
    assert resolve_reward(f"{FIXTURES}:graded_marked", {"scale": 2.0}).batched  # seen through the params wrapper
    assert not resolve_reward(f"{FIXTURES}:graded_declared").batched
    assert not resolve_reward(f"{FIXTURES}:graded").batched
    assert not resolve_reward("math").batched


def test_batch_results_are_checked_per_element():
    values = as_batch_rewards([1, True, 0.5, float("nan"), "x"], 5)
    assert values[:3] == [1.0, 1.0, 0.5]
    assert isinstance(values[3], RewardValueError) and "returned nan" in str(values[3])
    assert isinstance(values[4], RewardValueError)
    with pytest.raises(RewardValueError, match="expected length 3, got 2"):
        as_batch_rewards([1.0, 2.0], 3)
    with pytest.raises(RewardValueError, match="returned str, expected a list of 2 floats"):
        as_batch_rewards("12", 2)


def test_chunks_cover_the_batch_in_order():
    assert _chunks(7, 3) == [range(0, 2), range(2, 4), range(4, 7)]
    assert _chunks(2, 4) == [range(0, 1), range(1, 2)]  # never an empty call
    assert _chunks(0, 2) == []
    for n in range(12):
        for parts in range(1, 5):
            pieces = _chunks(n, parts)
            assert [i for piece in pieces for i in piece] == list(range(n))
            assert max(map(len, pieces), default=0) - min(map(len, pieces), default=0) <= 1


def test_columns_are_lists_with_none_for_missing_fields():
    call = _batch_call(0, [RewardInput("a", "x", None, {"tag": 1}), RewardInput("b", "y", "2", {"other": "o"})])
    assert call.prompts == ["a", "b"] and call.responses == ["x", "y"] and call.answers == [None, "2"]
    assert call.columns == {"tag": [1, None], "other": [None, "o"]}


# --------------------------------------------------------------------------- scoring


@pytest.mark.parametrize("name, batched_setting", [
    ("graded_batch", None),  # detected: first parameter named "prompts"
    ("graded_marked", None),  # detected: @batched
    ("graded_declared", True),  # declared in the term
])
def test_batched_equals_per_sample(name, batched_setting):
    data = graded_samples()
    terms = [RewardTerm(f"{FIXTURES}:graded", params={"scale": 0.5}),
             RewardTerm(f"{FIXTURES}:{name}", params={"scale": 0.5}, batched=batched_setting)]
    with RewardScorer(terms, timeout_s=10, num_workers=2) as scorer:
        assert scorer.batched == [False, True]
        result = scorer.score(data)
    per_sample, batch = result.per_term[f"{FIXTURES}:graded"], result.per_term[f"{FIXTURES}:{name}"]
    assert per_sample == [1 + 1.0 + 0, 1.5 + 1, 0.0, 1 + 1.0 + 3, 0.5 + 4, 2.0 + 5, 1 + 1.0 + 6]
    assert batch == per_sample
    assert result.errors == result.timeouts == 0


def test_results_do_not_depend_on_chunking_and_workers_share_the_batch():
    data = graded_samples()
    terms = [RewardTerm(f"{FIXTURES}:graded_batch"), RewardTerm(f"{FIXTURES}:call_size")]
    results = {}
    for workers in (1, 3):
        with RewardScorer(terms, timeout_s=10, num_workers=workers) as scorer:
            results[workers] = scorer.score(data).per_term
    assert results[1][f"{FIXTURES}:graded_batch"] == results[3][f"{FIXTURES}:graded_batch"]
    # One call of 7 with one worker; 2 + 2 + 3 with three (contiguous chunks, one per worker).
    assert results[1][f"{FIXTURES}:call_size"] == [7.0] * 7
    assert results[3][f"{FIXTURES}:call_size"] == [2.0, 2.0, 2.0, 2.0, 3.0, 3.0, 3.0]


def test_columns_are_lists_and_params_plain_values():
    data = [RewardInput("q", "r", None, {"tag": "t"}), RewardInput("q", "r", None, {})]
    with RewardScorer([RewardTerm(f"{FIXTURES}:column_echo", params={"mode": "bonus"})], num_workers=1) as scorer:
        result = scorer.score(data)
    assert result.rewards == [2.0, 1.0] and result.errors == 0


def test_declared_false_overrides_detection():
    with RewardScorer([RewardTerm(f"{FIXTURES}:prompts_per_sample", batched=False)], num_workers=1) as scorer:
        assert scorer.score(samples("a", "b")).rewards == [1.0, 1.0]


def test_failing_batch_calls_score_every_sample_zero_and_count_each():
    key = f"{FIXTURES}:misbehave"
    with RewardScorer([RewardTerm(f"{FIXTURES}:misbehave")], timeout_s=5, num_workers=1) as scorer:
        result = scorer.score(samples("a", "raise", "b", "c"))
        assert result.rewards == [0.0] * 4 and result.errors == 4 and result.timeouts == 0
        assert result.term_errors == {key: 4} and result.metrics()[f"reward/{key}/errors"] == 4
        assert result.first_error.startswith(f"term {key!r}, sample 0: ZeroDivisionError: asked to fail")

        result = scorer.score(samples("a", "short", "b"))
        assert result.rewards == [0.0] * 3 and result.errors == 3
        assert "returned 2 rewards for a call of 3 samples: expected length 3, got 2" in result.first_error

        result = scorer.score(samples("a", "text"))
        assert result.errors == 2 and "returned str, expected a list of 2 floats" in result.first_error

        result = scorer.score(samples("a", "nan", "b"))  # a bad element spoils only its own sample
        assert result.rewards == [1.0, 0.0, 1.0] and result.errors == 1
        assert result.first_error.startswith(f"term {key!r}, sample 1: returned nan")

        result = scorer.score(samples("crash", "a"))
        assert result.rewards == [0.0, 0.0] and result.errors == 2 and "died (exit code 7)" in result.first_error
        assert scorer.score(samples("a", "b")).rewards == [1.0, 1.0]  # the replacement worker scores


def test_hanging_batch_times_out_per_chunk_and_is_counted():
    key = f"{FIXTURES}:misbehave"
    terms = [RewardTerm(key), RewardTerm(f"{FIXTURES}:graded")]
    with RewardScorer(terms, timeout_s=10, batch_timeout_s=TIMEOUT_S, num_workers=2) as scorer:
        scorer.score(samples("warm-up", "up"))  # worker start-up is not part of the timeout
        result = scorer.score(samples("a", "hang", "b", "c"))
        # Two chunks: ["a", "hang"] times out as a whole, ["b", "c"] is scored; the per-sample
        # term is unaffected.
        assert result.per_term[key] == [0.0, 0.0, 1.0, 1.0]
        assert result.timeouts == 2 and result.errors == 0 and result.term_timeouts == {key: 2}
        assert result.per_term[f"{FIXTURES}:graded"] == [1.0, 4.0, 1.0, 1.0]
        assert f"no result within {TIMEOUT_S:g} s" in result.first_error
        assert scorer.pool.restarts == 1
        assert scorer.score(samples("d", "e")).rewards[0] == pytest.approx(1.0 + 1.0)


def test_unpicklable_column_fails_its_chunk():
    data = [RewardInput("q", "a", "a", {"handle": lambda: None}), RewardInput("q", "b", "b", {"handle": 1})]
    with RewardScorer([RewardTerm(f"{FIXTURES}:misbehave")], timeout_s=5, num_workers=1) as scorer:
        result = scorer.score(data)
    assert result.rewards == [0.0, 0.0] and result.errors == 2
    assert "the batch cannot be sent to a worker" in result.first_error


# --------------------------------------------------------------------------- configuration


def test_reward_config_batched_terms():
    config = RewardConfig.from_dict({"batch_timeout_s": 30, "num_workers": 1, "terms": [
        {"name": f"{FIXTURES}:graded_declared", "batched": True},
        {"name": f"{FIXTURES}:graded", "label": "per_sample"},
    ]})
    assert config.terms[0].batched is True and config.terms[1].batched is None and config.batch_timeout_s == 30
    with build_scorer(config) as scorer:
        assert scorer.pool.batch_timeout_s == 30 and scorer.pool.timeout_s == 10
        result = scorer.score(samples("ab", "a"))
    assert result.per_term[f"{FIXTURES}:graded_declared"] == result.per_term["per_sample"] == [3.0, 1.0]
    assert math.isclose(result.rewards[0], 6.0)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"terms": [{"name": "math", "batched": "yes"}]}, r"rewards.terms\[0\].batched must be true, false or null"),
        ({"batch_timeout_s": 0}, r"rewards.batch_timeout_s must be a number > 0"),
    ],
)
def test_reward_config_batched_errors(raw, message):
    with pytest.raises(ConfigError, match=message):
        RewardConfig.from_dict(raw)


def test_builtins_cannot_be_declared_batched():
    with pytest.raises(ConfigError, match=r"rewards.terms\[0\]: batched=true needs a user function; "
                                          r"the built-in 'math' is per-sample"):
        RewardScorer([RewardTerm("math", batched=True)])
