"""The reasoning tasks (retry, pad, pairs) and the per-step response statistics they feed."""

from __future__ import annotations

import collections
import re
import statistics

import pytest

from megatron_rl.errors import ConfigError
from megatron_rl.rewards.response_stats import count_responses, finalize_response_stats
from megatron_rl.rewards.synthetic import make_task, response_mode, verify_synthetic
from megatron_rl.train.scoring import combine_rounds


def _attempts(target: str) -> list[str]:
    return re.findall(r"(\d+) chk:(ok|no)", target)


def test_retry_traces_slip_check_and_box_the_last_attempt():
    task = make_task(task="retry", digits=3, min_digits=1, retry_noise=0.3, check_miss=0.1, attempts=3)
    records = task.generate(4000, seed=0, split="train")
    wrong_attempts = missed = total_attempts = 0
    for record in records:
        target, answer = record["target"], record["answer"]
        attempts = _attempts(target)
        assert 1 <= len(attempts) <= 3
        assert record["difficulty"] == len(record["prompt"].split("+")[0])
        for index, (digits, check) in enumerate(attempts):
            value = digits[::-1]  # attempts are written least significant digit first
            total_attempts += 1
            if value != answer:
                wrong_attempts += 1
                # a slip is one digit off by one, never a new leading zero
                assert len(value) == len(answer) and not (len(value) > 1 and value[0] == "0")
                differing = [(a, b) for a, b in zip(value, answer) if a != b]
                assert len(differing) == 1 and abs(int(differing[0][0]) - int(differing[0][1])) == 1
                missed += check == "ok"
            else:
                assert check == "ok"  # a right attempt always passes its check
            # the trace stops at the first passed check, or after the last attempt
            assert (check == "ok") == (index == len(attempts) - 1) or index == 2
        boxed = re.search(r"\\boxed\{(\d+)\}$", target)[1]
        assert boxed == attempts[-1][0][::-1]
        assert task.verify(target, answer) == float(boxed == answer)
    assert 0.25 < wrong_attempts / total_attempts < 0.35
    assert 0.05 < missed / wrong_attempts < 0.15
    # traces are drawn per record from the generator's stream: the same prompt can get other traces
    by_prompt = collections.defaultdict(set)
    for record in records:
        by_prompt[record["prompt"]].add(record["target"])
    assert any(len(targets) > 1 for targets in by_prompt.values())
    # and the whole split is a pure function of the seed
    assert task.generate(50, seed=0, split="train") == records[:50]


def test_retry_length_goes_with_wrongness_in_the_traces():
    """What the task is for: in the warm start's traces, wrong final answers are longer."""
    task = make_task(task="retry", digits=3, min_digits=1)
    records = task.generate(6000, seed=1, split="train")
    for digits in (1, 2, 3):  # at equal difficulty (a longer sum is a longer trace)
        same = [r for r in records if r["difficulty"] == digits]
        right = [len(r["target"]) for r in same if task.verify(r["target"], r["answer"])]
        wrong = [len(r["target"]) for r in same if not task.verify(r["target"], r["answer"])]
        assert wrong and statistics.fmean(wrong) > statistics.fmean(right) + 4, digits


def test_pad_filler_is_independent_of_the_answer():
    task = make_task(task="pad", digits=3, min_digits=1, pad_max=12)
    records = task.generate(2000, seed=0, split="train")
    fillers = [len(r["target"]) - len(r["target"].lstrip(".")) for r in records]
    assert 0.4 < sum(f == 0 for f in fillers) / len(fillers) < 0.6 and max(fillers) == 12
    for record in records[:200]:
        assert record["target"].lstrip(".") == f"{record['answer'][::-1]} \\boxed{{{record['answer']}}}"
        assert task.verify(record["target"], record["answer"]) == 1.0
    assert response_mode("pad", "...12 \\boxed{21}") == "padded"
    assert response_mode("pad", "12 \\boxed{21}") == "unpadded"


def test_pairs_accepts_every_split_and_nothing_else():
    task = make_task(task="pairs", max_operand=40)
    record = task.generate(1, seed=0, split="train")[0]
    n = int(record["answer"])
    assert record["prompt"] == f"sum {n}="
    for a in range(n + 1):
        assert verify_synthetic(f"\\boxed{{{a}+{n - a}}}", record["answer"], task="pairs") == 1.0
    for wrong in (f"\\boxed{{{n}+1}}", f"\\boxed{{{n}}}", f"{n}+0", f"\\boxed{{-1+{n + 1}}}", "\\boxed{1+2+3}"):
        assert verify_synthetic(wrong, record["answer"], task="pairs") == 0.0, wrong
    targets = {r["target"] for r in task.generate(500, seed=0, split="train") if r["answer"] == "30"}
    assert len(targets) > 3  # the warm start's splits are drawn, not one canonical answer


def test_reasoning_tasks_always_box_and_check_their_knobs():
    task = make_task(task="retry", response_format="plain")
    record = task.generate(1, seed=0, split="train")[0]
    assert record["response_format"] == "boxed"
    assert task.verify(record["answer"], record["answer"]) == 0.0  # an unboxed answer is not an answer
    for bad, key in (({"min_digits": 4, "digits": 3}, "min_digits"), ({"attempts": 0}, "attempts"),
                     ({"retry_noise": 1.0}, "retry_noise"), ({"check_miss": -0.1}, "check_miss"),
                     ({"pad_max": 1000}, "pad_max")):
        with pytest.raises(ConfigError, match=key):
            make_task(task="retry", **bad)


def test_response_stats_add_up_across_rounds_and_read_modes():
    retry = {"task": "retry", "difficulty": 2}
    pairs = {"task": "pairs"}
    round_one = count_responses([
        [(retry, "21 chk:ok \\boxed{12}", 1.0, 10), (retry, "31 chk:no 21 chk:ok \\boxed{12}", 1.0, 20),
         (retry, "31 chk:no 41 chk:no 51 chk:no \\boxed{15}", 0.0, 30), (retry, "31 chk:", 0.0, 64)],
    ])
    round_two = count_responses([
        [(pairs, "\\boxed{3+4}", 1.0, 6), (pairs, "\\boxed{4+3}", 1.0, 6), (pairs, "\\boxed{3+4}", 1.0, 6),
         (pairs, "\\boxed{9+9}", 0.0, 6)],
        [({"task": "retry", "difficulty": 3}, "1 chk:ok \\boxed{1}", 0.0, 9)] * 2,
    ])
    # two scoring rounds of different sizes, combined the way a step combines them
    metrics = finalize_response_stats(combine_rounds([(4, round_one), (10, round_two)]))
    assert metrics["length/d2/correct_mean"] == 15.0 and metrics["length/d2/wrong_mean"] == 47.0
    assert metrics["accuracy/d2"] == 0.5 and metrics["accuracy/d3"] == 0.0
    assert "length/d3/correct_mean" not in metrics and metrics["length/d3/wrong_mean"] == 9.0
    # retry modes over the 6 retry samples: attempts_1 x3 (one in round one, two in round two)
    assert metrics["mode/attempts_1"] == pytest.approx(3 / 6)
    assert metrics["mode/attempts_2"] == pytest.approx(1 / 6)
    assert metrics["mode/attempts_3"] == pytest.approx(1 / 6)
    assert metrics["mode/no_answer"] == pytest.approx(1 / 6)
    # distinct correct answers per group: 1 ("12"), 2 ("3+4", "4+3"), 0
    assert metrics["answers/distinct_correct_per_group"] == pytest.approx(3 / 3)
    assert not any(key.startswith("responses_count/") for key in metrics)
