"""The synthetic code task (`task: expr`): a hidden function shown by a few values, answered by a
one-line Python expression in x and scored by the `code_tests` reward on hidden inputs.

Checked against independent re-derivations: the forms are re-enumerated here, the expected
outputs computed by Python itself, and every canonical answer run through the real reward (the
harness of configs/tiny_code.yaml, the real sandbox, the scorer's worker processes).
"""

from __future__ import annotations

import re

import pytest
import yaml

from _support.processes import REPO
from megatron_rl.data.tokenizer import ALPHABET
from megatron_rl.errors import ConfigError
from megatron_rl.rewards import resolve_reward
from megatron_rl.rewards.scoring import RewardInput, RewardScorer, RewardTerm
from megatron_rl.rewards.synthetic import make_task, verify_synthetic

RECIPE = yaml.safe_load((REPO / "configs/tiny_code.yaml").read_text())
TASK = RECIPE["data"]["synthetic"]             # the recipe's task settings
TERM = RECIPE["rewards"]["terms"][0]           # the recipe's code_tests term (its harness)
ALL_FORMS = "add,sub,mul,affine,square,mod"


def shown(prompt: str) -> list[tuple[int, int]]:
    assert prompt.endswith(" f(x)="), prompt
    return [(int(x), int(y)) for x, y in re.findall(r"f\((\d+)\)=(-?\d+)", prompt)]


def candidates(forms: str, limit: int) -> list[str]:
    """Every function of the forms, written out independently of the generator's table."""
    out = []
    for a in range(2, limit + 1):
        out += [f"x*{a}"] * ("mul" in forms) + [f"x%{a}"] * ("mod" in forms)
        out += [f"x*{a}+{b}" for b in range(1, limit + 1)] * ("affine" in forms)
    for b in range(1, limit + 1):
        out += [f"x+{b}"] * ("add" in forms) + [f"x-{b}"] * ("sub" in forms) + [f"x*x+{b}"] * ("square" in forms)
    return out


def value(expression: str, x: int) -> int:
    return eval(expression, {"__builtins__": {}}, {"x": x})  # our own canonical answers only


def test_the_recipe_uses_this_task_and_harness():
    assert TASK["task"] == "expr" and TERM["name"] == "code_tests" and "{code}" in TERM["params"]["harness"]


@pytest.mark.parametrize("forms", ["add,mul", ALL_FORMS])
def test_generation_is_deterministic_and_splits_disjoint(forms):
    task = make_task(task="expr", forms=forms, max_operand=9, heldout_fraction=0.2)
    train = task.generate(400, seed=3, split="train")
    assert train == make_task(task="expr", forms=forms, max_operand=9, heldout_fraction=0.2).generate(
        400, seed=3, split="train")
    assert train != task.generate(400, seed=4, split="train")
    heldout = [r["prompt"] for r in task.generate(100, seed=0, split="heldout")]
    assert len(set(heldout)) == len(heldout)
    assert not {r["prompt"] for r in train} & set(heldout)
    assert len({r["answer"] for r in train}) > 10  # many functions, not a handful


@pytest.mark.parametrize("forms,examples,shown_max", [("add,mul", 2, 9), (ALL_FORMS, 3, 9), ("add,mul,affine", 2, 3)])
def test_shown_values_determine_the_function_and_tests_are_hidden(forms, examples, shown_max):
    task = make_task(task="expr", forms=forms, max_operand=9, examples=examples, shown_max=shown_max, hidden_tests=5)
    pool = candidates(forms, 9)
    for record in task.generate(200, seed=1, split="train"):
        pairs = shown(record["prompt"])
        assert len(pairs) == examples and len({x for x, _ in pairs}) == examples
        assert all(0 <= x <= shown_max for x, _ in pairs)
        fitting = [c for c in pool if all(value(c, x) == y for x, y in pairs)]
        assert fitting == [record["answer"]], (record["prompt"], fitting)
        inputs = [int(t["stdin"]) for t in record["tests"]]
        assert len(set(inputs)) == 5 and not set(inputs) & {x for x, _ in pairs}
        assert all(t["stdin"] == f"{x}\n" and t["stdout"] == f"{value(record['answer'], x)}\n"
                   for x, t in zip(inputs, record["tests"]))
        assert set(record["prompt"] + record["target"]) <= set(ALPHABET)


def test_canonical_answers_pass_their_tests_in_the_sandbox_and_wrong_ones_fail():
    task = make_task(**TASK)
    records = task.generate(24, seed=0, split="heldout")
    samples = []
    for record in records:
        answer = record["answer"]
        # a near miss: the last constant off by one (same form, so only running it tells)
        wrong = re.sub(r"\d+$", lambda m: str(int(m.group()) + 1), answer)
        for response in (answer, wrong, "x"):
            samples.append(RewardInput(record["prompt"], response, answer, {"tests": record["tests"]}))
    with RewardScorer([RewardTerm("code_tests", params=TERM["params"])], timeout_s=60, num_workers=2) as scorer:
        result = scorer.score(samples)
    assert result.errors == 0 and result.timeouts == 0, result.first_error
    assert result.rewards == [1.0, 0.0, 0.0] * len(records)


def test_lookup_demonstrations_fit_the_prompt_and_fail_every_hidden_test():
    task = make_task(**TASK)
    records = task.generate(400, seed=0, split="train")
    lookups = [r for r in records if r["target"] != r["answer"]]
    share = 1 - len(lookups) / len(records)
    assert abs(share - TASK["general_demonstrations"]) < 0.08, share
    assert all(r["target"] == r["answer"] for r in records if r not in lookups)
    assert all(set(r["target"]) <= set(ALPHABET) for r in lookups)
    samples = []
    for record in lookups[:12]:
        pairs = shown(record["prompt"])
        assert [value(record["target"], x) for x, _ in pairs] == [y for _, y in pairs]  # right on the prompt
        on_prompt = [{"stdin": f"{x}\n", "stdout": f"{y}\n"} for x, y in pairs]
        samples += [RewardInput(record["prompt"], record["target"], record["answer"], {"tests": record["tests"]}),
                    RewardInput(record["prompt"], record["target"], record["answer"], {"tests": on_prompt})]
        assert task.verify(record["target"], record["answer"]) == 0.0
    with RewardScorer([RewardTerm("code_tests", params=TERM["params"])], timeout_s=60, num_workers=2) as scorer:
        result = scorer.score(samples)
    assert result.errors == 0 and result.rewards == [0.0, 1.0] * 12, result.rewards


def test_the_task_verifier_compares_functions_without_running_the_text():
    task = make_task(task="expr")
    assert task.verify("x*2", "x*2") == task.verify("2*x", "x*2") == task.verify("x+x", "x*2") == 1.0
    assert task.verify("(x+3)%7", "(x+3)%7") == 1.0 and task.verify("x*2+1", "x*2") == 0.0
    for hostile in ("__import__('os').system('true')", "print(1)", "x**999999", "9" * 300, "x//0", "x.real"):
        assert task.verify(hostile, "x*2") == 0.0
    assert verify_synthetic("\\boxed{x+4}", "x+4", task="expr", response_format="boxed") == 1.0
    assert resolve_reward("synthetic:expr").fn("f(1)=2 f(x)=", "x+1", "x+1") == 1.0


def test_bad_settings_are_named():
    with pytest.raises(ConfigError, match=r"task\.forms must be a comma-separated list of add, sub"):
        make_task(task="expr", forms="add,cube")
    with pytest.raises(ConfigError, match=r"task\.examples must be in \[1, shown_max \+ 1 = 4\]"):
        make_task(task="expr", examples=5, shown_max=3)
    with pytest.raises(ConfigError, match=r"task\.shown_max must be in \[1, 9\]"):
        make_task(task="expr", shown_max=10)
    with pytest.raises(ConfigError, match=r"task\.hidden_tests must be in \[1, 90\]"):
        make_task(task="expr", hidden_tests=91)
