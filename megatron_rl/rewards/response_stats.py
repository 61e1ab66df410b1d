"""Per-step statistics of what the responses are, beyond their rewards: length by correctness and
difficulty, the shares of a task's response modes, distinct correct answers per group.

The length and entropy dynamics the GRPO-family papers describe (docs/reproductions.md) show in
these: wrong responses growing longer (Dr. GRPO), a group's answers collapsing onto one
(DAPO's entropy collapse), retries becoming more or less frequent.

Scoring happens in rounds (dynamic sampling refills, score_chunks requests, one group at a time
when asynchronous), and `train/scoring.combine_rounds` adds up every key that is not a mean. So
`count_responses` returns raw counts and sums under `COUNT_PREFIX`, which add up exactly across
rounds, and `finalize_response_stats` turns the step's totals into the logged means and shares:

    length/d<k>/correct_mean, length/d<k>/wrong_mean   response tokens, records of difficulty k
    accuracy/d<k>                                       share correct among them
    mode/<name>                                         share of the samples in that mode
                                                        (synthetic.response_mode: retry attempts_1..,
                                                        no_answer; pad padded / unpadded)
    answers/distinct_correct_per_group                  distinct correct answers (the answer as the
                                                        synthetic task extracts it), mean over groups
                                                        of synthetic-task records
"""

from __future__ import annotations

import functools
from typing import Sequence

from megatron_rl.rewards.functions import CORRECT
from megatron_rl.rewards.synthetic import REASONING_TASKS, TASKS, make_task, response_mode

__all__ = ["COUNT_PREFIX", "count_responses", "finalize_response_stats"]

COUNT_PREFIX = "responses_count/"


def count_responses(groups: Sequence[Sequence[tuple[dict, str, float, int]]]) -> dict[str, float]:
    """Raw counts of one scoring round. `groups`: per prompt group, its samples as (record
    metadata, decoded response, reward, response tokens)."""
    counts: dict[str, float] = {}

    def add(key: str, value: float = 1.0) -> None:
        counts[COUNT_PREFIX + key] = counts.get(COUNT_PREFIX + key, 0.0) + value

    for group in groups:
        if not group:
            continue
        distinct = set()
        for metadata, response, reward, length in group:
            correct = reward >= CORRECT
            difficulty = metadata.get("difficulty")
            if isinstance(difficulty, int) and not isinstance(difficulty, bool):
                kind = "correct" if correct else "wrong"
                add(f"d{difficulty}/{kind}/n")
                add(f"d{difficulty}/{kind}/tokens", float(length))
            task = metadata.get("task")
            if task in REASONING_TASKS:
                mode = response_mode(task, response)
                if mode is not None:
                    add(f"mode/{mode}")
                    add("mode/_total")
            if task in TASKS and correct:
                distinct.add(_extractor(task, metadata.get("response_format", "plain"))(response))
        if group[0][0].get("task") in TASKS:
            add("groups")
            add("distinct_correct", float(len(distinct)))
    return counts


@functools.lru_cache(maxsize=64)
def _extractor(task: str, response_format: str):
    return make_task(task=task, response_format=response_format).extract


def finalize_response_stats(metrics: dict) -> dict:
    """`metrics` with the step's raw counts (COUNT_PREFIX) replaced by the means and shares."""
    raw = {key[len(COUNT_PREFIX):]: value for key, value in metrics.items() if key.startswith(COUNT_PREFIX)}
    out = {key: value for key, value in metrics.items() if not key.startswith(COUNT_PREFIX)}
    difficulties = sorted({key.split("/")[0] for key in raw if key.startswith("d") and key.endswith("/n")})
    for d in difficulties:
        n_correct, n_wrong = raw.get(f"{d}/correct/n", 0.0), raw.get(f"{d}/wrong/n", 0.0)
        for kind, n in (("correct", n_correct), ("wrong", n_wrong)):
            if n:
                out[f"length/{d}/{kind}_mean"] = raw[f"{d}/{kind}/tokens"] / n
        out[f"accuracy/{d}"] = n_correct / (n_correct + n_wrong)
    total = raw.get("mode/_total", 0.0)
    if total:
        for key, value in raw.items():
            if key.startswith("mode/") and key != "mode/_total":
                out[key] = value / total
    if raw.get("groups"):
        out["answers/distinct_correct_per_group"] = raw["distinct_correct"] / raw["groups"]
    return out
