"""One prompt set through the project's engines and reward functions: n samples per prompt plus a
greedy response, scored, as a records.SetOutcome. The one evaluation loop: `megatron-rl eval`
(evaluation/command.py) and the in-training evaluation both call `evaluate_set`.

    outcome = evaluate_set(records, generation=generation, scorer=scorer,
                           params=SamplingParams(n=8, temperature=1.0, top_p=1.0, max_tokens=512, seed=1234),
                           name="gsm8k", path="data/gsm8k_test.jsonl")

Seeds: prompt i of the set always samples with `params.prompt_seed(i)` (the engines derive each of
its n samples' seeds from that one), however the set is cut into requests: two checkpoints
evaluated with the same `params.seed` see the same prompts with the same seeds, so their
difference is the weights' and not the sampler's.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Callable, Sequence

from megatron_rl.evaluation.records import PromptOutcome, SampleOutcome, SetOutcome
from megatron_rl.rewards.functions import CORRECT  # the trainer's threshold: rule rewards are 0 or 1
from megatron_rl.rollout.protocol import Sample, SamplingParams

# Prompts per engine request: small enough for the progress bar to move, large enough that the
# engine batches them (vLLM schedules a request's prompts together).
CHUNK_PROMPTS = 64

AnswerOf = Callable[[object, str], "str | None"]  # (record, response text) -> the answer maj@k votes on


def evaluate_set(records: Sequence, *, generation, scorer, params: SamplingParams, name: str, path: str,
                 greedy: bool = True, threshold: float = CORRECT, answer_of: AnswerOf | None = None,
                 keep_texts: int = 0, chunk_prompts: int = CHUNK_PROMPTS,
                 progress: Callable[[int, int], None] | None = None) -> SetOutcome:
    """Collective (every rank calls it with the same arguments and gets the same outcome, as
    train/evaluate.py: the engines answer every rank alike and rewards come from the driver).

    `records`: the set's data.PromptRecord's, in set order (PromptOutcome.index is the position);
    `generation`: records -> samples, the project's train/generation.Generation (single- or
    multi-turn; anything with `.groups(records, params) -> list[list[Sample]]`);
    `scorer`: the project's train/scoring.GroupScorer built on the set's reward terms (anything
    with `.score(records, groups) -> (trajectories, metrics)`, collective, and `.tokenizer`);
    `params`: the sampled responses' SamplingParams: n, temperature, top_p, max_tokens and the
    base seed (required: the same seed gives every checkpoint the same per-prompt seeds);
    `greedy`: also one temperature-0 response per prompt (PromptOutcome.greedy);
    `threshold`: reward >= threshold counts as correct;
    `answer_of(record, text)`: the extracted answer maj@k votes on (default `default_answer_of`:
    the synthetic task's extractor for its records, else the math answer; None: no vote);
    `keep_texts`: the first this many prompts keep their prompt and response texts (for the
    samples written beside the report; the others keep "");
    `chunk_prompts`: prompts per engine request (seeds do not depend on it);
    `progress(done, total)`: called after each request with the prompts finished so far.
    """
    if params.seed is None:
        raise ValueError(f"evaluate_set({name!r}): SamplingParams.seed is None; a seed is what lets two "
                         "checkpoints be compared on the same samples' seeds")
    answer_of = answer_of or default_answer_of
    greedy_params = replace(params, n=1, temperature=0.0, top_p=1.0)
    outcome = SetOutcome(name=name, path=str(path), n=params.n, temperature=params.temperature,
                         top_p=params.top_p, threshold=threshold)
    total = len(records)
    step = max(1, chunk_prompts)
    for start in range(0, total, step):
        chunk = list(records[start:start + step])
        sampled = _scored(chunk, generation, scorer, params.offset(start), threshold, answer_of)
        best = _scored(chunk, generation, scorer, greedy_params.offset(start), threshold, answer_of) \
            if greedy else [None] * len(chunk)
        for offset, (record, samples, greedy_group) in enumerate(zip(chunk, sampled, best)):
            index = start + offset
            keep = index < keep_texts
            if not keep:
                for sample in samples + (greedy_group or []):
                    sample.text = ""
            outcome.prompts.append(PromptOutcome(index=index, samples=samples,
                                                 greedy=greedy_group[0] if greedy_group else None,
                                                 prompt=_prompt_text(record) if keep else ""))
        if progress is not None:
            progress(min(start + step, total), total)
    return outcome


def _scored(records: list, generation, scorer, params: SamplingParams, threshold: float,
            answer_of: AnswerOf) -> list[list[SampleOutcome]]:
    """Collective: one request's groups as SampleOutcome's (texts kept; the caller drops them)."""
    groups: list[list[Sample]] = generation.groups(records, params)
    trajectories, _ = scorer.score(records, groups)
    outcomes = []
    for record, group, scored in zip(records, groups, trajectories):
        row = []
        for sample, trajectory in zip(group, scored):
            ids = sample.extras.get("final_response_ids", sample.response_token_ids)
            text = scorer.tokenizer.decode(ids, skip_special_tokens=True)
            row.append(SampleOutcome(reward=float(trajectory.reward), correct=trajectory.reward >= threshold,
                                     answer=answer_of(record, text), length=len(sample.response_token_ids),
                                     truncated=sample.finish_reason == "length", text=text))
        outcomes.append(row)
    return outcomes


def default_answer_of(record, text: str) -> str | None:
    """The answer maj@k votes on: a synthetic-task record's (its own extractor, by its metadata
    "task" and "response_format"), else the math answer (boxed, "####", "the answer is").
    Code-test records have no answer to vote on (None)."""
    metadata = getattr(record, "metadata", None) or {}
    if "tests" in metadata:
        return None
    task = metadata.get("task")
    if task is not None:
        extracted = _synthetic_extractor(task, metadata.get("response_format", "plain"))
        if extracted is not None:
            answer = extracted(text)
            return None if answer is None else str(answer)
    from megatron_rl.rewards.math_answer import extract_answer, normalize_answer

    answer = extract_answer(text)
    return None if answer is None else normalize_answer(answer)


@functools.lru_cache(maxsize=64)
def _synthetic_extractor(task: str, response_format: str):
    from megatron_rl.rewards.synthetic import TASKS, make_task

    return make_task(task=task, response_format=response_format).extract if task in TASKS else None


def _prompt_text(record) -> str:
    from megatron_rl.data import prompt_text

    return prompt_text(record.prompt)
