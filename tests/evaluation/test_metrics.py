"""The evaluation figures (evaluation/metrics.py): pass@k against its definition for every n <= 64
and against an independent form written here (drawing k of n one at a time) and a Monte Carlo
draw; maj@k's tie rule, None answers and blocks on constructed prompts; every figure of a small set
worked by hand; the bootstrap interval's determinism and its coverage over prompts; the paired
comparison (a checkpoint against itself is exactly 0, the pairing narrows the interval)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from megatron_rl.errors import ConfigError
from megatron_rl.evaluation.metrics import (compare, default_ks, flat_metrics, maj_at_k, majority_vote, pass_at_k,
                                            set_figures)
from megatron_rl.evaluation.records import PromptOutcome, SampleOutcome, SetOutcome


def sample(answer, correct, length=10, truncated=False, reward=None):
    return SampleOutcome(reward=float(correct) if reward is None else reward, correct=correct, answer=answer,
                         length=length, truncated=truncated)


def bernoulli_set(rng: random.Random, probabilities, n, name="math", greedy=False):
    """One prompt per probability, n samples each, correct with that probability (answer "42" when
    correct, one of three wrong answers otherwise)."""
    prompts = []
    for index, p in enumerate(probabilities):
        samples = [sample("42", True) if rng.random() < p else sample(str(rng.randint(0, 2)), False) for _ in range(n)]
        prompts.append(PromptOutcome(index=index, samples=samples, greedy=sample("42", True) if greedy else None))
    return SetOutcome(name=name, path=f"{name}.jsonl", n=n, temperature=1.0, top_p=1.0, threshold=0.5,
                      prompts=prompts)


def test_pass_at_k_equals_its_definition_and_a_draw_by_draw_form_for_every_n_up_to_64():
    """Every n <= 64, c <= n, k <= n: the estimator against 1 - C(n-c,k)/C(n,k) (math.comb, exact
    integers, one correctly rounded division), and against the probability that k draws without
    replacement all miss, multiplied out draw by draw (a product over the k draws, where the
    estimator's is over the c correct samples)."""
    worst_definition = worst_draws = 0.0
    for n in range(1, 65):
        for c in range(n + 1):
            # P(the first d draws all miss), d = 1..n, as a running product over the draws
            all_miss = np.cumprod([max(n - c - draw, 0) / (n - draw) for draw in range(n)])
            for k in range(1, n + 1):
                estimate = pass_at_k(n, c, k)
                definition = 1.0 - math.comb(n - c, k) / math.comb(n, k)
                worst_definition = max(worst_definition, abs(estimate - definition))
                worst_draws = max(worst_draws, abs(estimate - (1.0 - all_miss[k - 1])))
                if n - c < k:
                    assert estimate == 1.0, (n, c, k)
    assert worst_definition < 1e-13 and worst_draws < 1e-13, (worst_definition, worst_draws)


@pytest.mark.parametrize("n, c, k", [(16, 4, 4), (10, 1, 3), (64, 5, 8), (8, 6, 2)])
def test_pass_at_k_is_the_chance_that_k_of_n_drawn_without_replacement_hold_a_correct_one(n, c, k):
    draws = 20_000
    rng = np.random.default_rng(1234)
    chosen = rng.random((draws, n)).argsort(axis=1)[:, :k]  # k distinct samples per draw
    hit = float((chosen < c).any(axis=1).mean())  # samples 0..c-1 are the correct ones
    expected = pass_at_k(n, c, k)
    sigma = math.sqrt(expected * (1 - expected) / draws)
    assert abs(hit - expected) <= 4 * sigma + 1e-9, (hit, expected)


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError, match=f"n={n}, c={c}, k={k}"):
            pass_at_k(n, c, k)


def test_a_vote_counts_ties_fractionally_and_never_counts_none():
    right, wrong, other = ("42", True), ("7", False), ("8", False)
    cases = [
        ([right, right, wrong], 1.0),  # a clear majority, right
        ([wrong, wrong, right], 0.0),  # a clear majority, wrong
        ([right, wrong], 0.5),  # a two-way tie with the right answer among it
        ([right, wrong, other], 1 / 3),  # a three-way tie
        ([wrong, other], 0.0),  # a tie of wrong answers
        ([(None, False)] * 3 + [right], 1.0),  # three unextractable answers do not outvote one
        ([(None, False)] * 2, 0.0),  # nothing votes
        ([right, right, wrong, wrong, other], 0.5),
    ]
    for votes, expected in cases:
        samples = [sample(a, ok) for a, ok in votes]
        assert majority_vote(samples) == pytest.approx(expected, abs=1e-15), votes
        assert majority_vote(list(reversed(samples))) == pytest.approx(expected, abs=1e-15), votes
    # The same answer judged right once and wrong once (a reward that is not the answer alone): half right.
    assert majority_vote([sample("42", True), sample("42", False), sample("7", False)]) == 0.5


def test_maj_at_k_averages_the_votes_of_consecutive_blocks_of_k():
    samples = [sample("42", True), sample("7", False), sample("42", True), sample("42", True), sample("9", False)]
    # k=2: blocks (42, 7) -> tie -> 0.5 and (42, 42) -> 1; the fifth sample votes in no block.
    assert maj_at_k(samples, 2) == 0.75
    assert maj_at_k(samples, 5) == 1.0  # 42 three times out of five
    assert maj_at_k(samples, 1) == 3 / 5  # maj@1 is the share of correct samples
    assert maj_at_k(samples, 3) == 1.0  # one block: 42, 7, 42
    with pytest.raises(ValueError, match="n=5, k=6"):
        maj_at_k(samples, 6)


def test_every_figure_of_a_small_set_worked_by_hand():
    prompts = [
        PromptOutcome(0, [sample("42", True, 10), sample("1", False, 20, reward=0.2), sample("42", True, 30),
                          sample("2", False, 40, True)], greedy=sample("42", True)),
        PromptOutcome(1, [sample("1", False, 50), sample(None, False, 60, True), sample("2", False, 70),
                          sample("1", False, 80, True)], greedy=sample("1", False)),
    ]
    outcome = SetOutcome("toy", "toy.jsonl", n=4, temperature=1.0, top_p=1.0, threshold=0.5, prompts=prompts)
    figures = set_figures(outcome, [1, 2, 4], resamples=50)["figures"]
    value = {name: f["value"] for name, f in figures.items()}
    assert value["pass@1"] == pytest.approx((2 / 4 + 0) / 2)
    assert value["pass@2"] == pytest.approx((1 - 1 / 6 + 0) / 2)  # C(2,2)/C(4,2) = 1/6 of pairs miss
    assert value["pass@4"] == pytest.approx(0.5)
    assert value["avg@4"] == pytest.approx((1 + 0.2 + 1 + 0) / 4 / 2)
    assert value["maj@2"] == pytest.approx((0.5 * (0.5 + 0.5) + 0) / 2)  # (42,1) tie, (42,2) tie
    assert value["maj@4"] == pytest.approx((1 + 0) / 2)  # 42 twice against 1 and 2; 1 twice (wrong)
    assert value["greedy"] == 0.5
    assert value["length_mean"] == 45.0
    assert value["length_p50"] == 45.0
    assert value["length_p95"] == pytest.approx(80 - 0.05 * 7 * 10)  # numpy's linear rule: rank 6.65 of 0..7
    assert value["truncated_share"] == 3 / 8
    assert list(figures) == ["pass@1", "pass@2", "pass@4", "avg@4", "maj@1", "maj@2", "maj@4", "greedy",
                             "length_mean", "length_p50", "length_p95", "truncated_share"]
    for f in figures.values():
        assert f["low"] <= f["value"] <= f["high"]


def test_a_set_without_extracted_answers_reports_no_majority_vote_unless_compared_with_one_that_has():
    """Code judged by tests has no answer to vote on: maj@k would read 0 there, so it is left out;
    against a checkpoint that does give answers, its 0 is what the comparison shows."""
    tested = bernoulli_set(random.Random(4), [0.5] * 6, n=4)
    for prompt in tested.prompts:
        for s in prompt.samples:
            s.answer = None
    figures = set_figures(tested, [1, 4], resamples=20)["figures"]
    assert not [name for name in figures if name.startswith("maj@")] and figures["pass@1"]["value"] > 0
    answered = bernoulli_set(random.Random(4), [0.5] * 6, n=4)
    difference = compare(tested, answered, [1, 4], resamples=20)["figures"]["maj@4"]
    assert difference["a"] == 0.0 and difference["b"] == set_figures(answered, [1, 4])["figures"]["maj@4"]["value"]


def test_asked_ks_are_checked_against_n_and_the_set_against_its_contract():
    outcome = bernoulli_set(random.Random(0), [0.5] * 3, n=8)
    with pytest.raises(ConfigError, match=r"'math': k must be in 1\.\.n=8 .*\[1, 16\]"):
        set_figures(outcome, [1, 16])
    with pytest.raises(ConfigError, match="k must be in"):
        set_figures(outcome, [0])
    with pytest.raises(ConfigError, match=r"k must be in .*\[True\]"):  # a bool is not a k (True == 1)
        set_figures(outcome, [True])
    assert set_figures(outcome, None, resamples=10)["ks"] == default_ks(8) == [1, 2, 4, 8]
    assert default_ks(12) == [1, 2, 4, 8, 12] and default_ks(1) == [1]
    outcome.prompts[1].samples.pop()
    with pytest.raises(ValueError, match="prompt 1 has 7 samples, the set says n=8"):
        set_figures(outcome)
    half_greedy = bernoulli_set(random.Random(0), [0.5] * 3, n=2, greedy=True)
    half_greedy.prompts[0].greedy = None
    with pytest.raises(ValueError, match="some prompts have a greedy response and some not"):
        set_figures(half_greedy)
    with pytest.raises(ValueError, match="has no prompts"):
        set_figures(SetOutcome("empty", "e.jsonl", 4, 1.0, 1.0, 0.5, []))


def test_the_bootstrap_is_deterministic_for_a_seed_and_moves_with_it():
    outcome = bernoulli_set(random.Random(3), [0.1, 0.5, 0.9, 0.3, 0.7] * 6, n=4, greedy=True)
    first = set_figures(outcome, [1, 4], resamples=200, seed=7)
    assert set_figures(outcome, [1, 4], resamples=200, seed=7) == first
    other = set_figures(outcome, [1, 4], resamples=200, seed=8)
    assert [f["value"] for f in other["figures"].values()] == [f["value"] for f in first["figures"].values()]
    assert [(f["low"], f["high"]) for f in other["figures"].values()] != \
        [(f["low"], f["high"]) for f in first["figures"].values()]


def test_the_interval_covers_the_population_pass_rate_about_95_percent_of_the_time():
    """Prompts of very different difficulty: an interval over prompts covers the mean pass rate of
    the population of prompts about 95% of the time (one that resampled samples, not prompts,
    would be far too narrow and cover it much less often)."""
    rng = random.Random(11)
    trials, covered = 120, 0
    for trial in range(trials):
        difficulty = [rng.choice([0.05, 0.5, 0.95]) for _ in range(30)]  # population mean: 0.5
        outcome = bernoulli_set(rng, difficulty, n=4)
        interval = set_figures(outcome, [1], resamples=300, seed=trial)["figures"]["pass@1"]
        covered += interval["low"] <= 0.5 <= interval["high"]
    # 95% of 120: 114; a binomial's 3-sigma band is about 107 to 120.
    assert 105 <= covered <= 120, covered


def test_a_checkpoint_compared_with_itself_differs_by_exactly_zero():
    outcome = bernoulli_set(random.Random(5), [0.2, 0.6, 0.9] * 5, n=8, greedy=True)
    comparison = compare(outcome, outcome, [1, 2, 8], resamples=200)
    assert set(comparison["figures"]) == set(set_figures(outcome, [1, 2, 8], resamples=10)["figures"])
    for name, f in comparison["figures"].items():
        assert f["a"] == f["b"] and (f["difference"], f["low"], f["high"]) == (0.0, 0.0, 0.0), name


def test_the_paired_interval_resamples_the_same_prompts_for_both_checkpoints():
    """B is A with two more correct samples on every third prompt: per prompt the two move
    together, so the paired interval of B - A is far narrower than either checkpoint's own."""
    rng = random.Random(9)
    a = bernoulli_set(rng, [rng.random() for _ in range(60)], n=8)
    b = SetOutcome.from_json(a.to_json())
    for prompt in b.prompts[::3]:
        wrong = [i for i, s in enumerate(prompt.samples) if not s.correct][:2]
        for i in wrong:
            prompt.samples[i] = sample("42", True)
    paired = compare(a, b, [1], resamples=400)["figures"]["pass@1"]
    own = set_figures(a, [1], resamples=400)["figures"]["pass@1"]
    gained = sum(min(2, sum(not s.correct for s in p.samples)) for p in a.prompts[::3]) / (8 * 60)
    assert paired["difference"] == pytest.approx(gained)
    assert 0 < paired["low"] <= paired["difference"] <= paired["high"]
    assert paired["high"] - paired["low"] < 0.5 * (own["high"] - own["low"])


def test_compare_refuses_different_prompts_or_sets():
    a = bernoulli_set(random.Random(1), [0.5] * 4, n=4)
    b = SetOutcome.from_json(a.to_json())
    b.prompts[2].index = 17
    with pytest.raises(ValueError, match="different prompts"):
        compare(a, b)
    c = bernoulli_set(random.Random(1), [0.5] * 4, n=4, name="gsm8k")
    with pytest.raises(ValueError, match="cannot compare set 'math' .* with set 'gsm8k'"):
        compare(a, c)
    greedy = bernoulli_set(random.Random(1), [0.5] * 4, n=4, greedy=True)
    for first, second in ((a, greedy), (greedy, a)):
        with pytest.raises(ValueError, match="'math': greedy responses on one checkpoint only"):
            compare(first, second)


def test_flat_metrics_name_every_figure_under_eval_and_the_set():
    outcome = bernoulli_set(random.Random(2), [0.5] * 4, n=4, greedy=True)
    figures = set_figures(outcome, [1, 4], resamples=10)
    flat = flat_metrics("math", figures)
    assert flat["eval/math/pass@1"] == figures["figures"]["pass@1"]["value"]
    assert set(flat) == {"eval/math/prompts", "eval/math/pass@1", "eval/math/pass@4", "eval/math/avg@4",
                         "eval/math/maj@1", "eval/math/maj@4", "eval/math/greedy", "eval/math/length_mean",
                         "eval/math/length_p50", "eval/math/length_p95", "eval/math/truncated_share"}
    assert flat["eval/math/prompts"] == 4.0
