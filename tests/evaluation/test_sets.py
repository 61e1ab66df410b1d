"""A set's options as `megatron-rl eval` reads them (evaluation/sets.py), in process and without
an engine: a HumanEval-format set's reward where the namespace sandbox cannot be built (refused
naming the set's own option, which then resolves), reward_params without a reward."""

from __future__ import annotations

import json

import pytest

from megatron_rl.config import load_config
from megatron_rl.errors import ConfigError
from megatron_rl.evaluation.humaneval import SANDBOX_PARAMS
from megatron_rl.evaluation.set_rewards import set_rewards
from megatron_rl.evaluation.sets import SamplingDefaults, SetNaming, load_set, parse_sets

HUMANEVAL_ROW = {"task_id": "t/0", "prompt": "def f(x):\n", "test": "def check(c):\n    assert c(1) == 2\n",
                 "entry_point": "f"}


def resolved(set_args: list[str], options: list[str] = ()):
    """Each named set read and its reward resolved as `megatron-rl eval` does before any engine."""
    run = load_config(None, [])
    specs = parse_sets(set_args, None, list(options), SamplingDefaults())
    return [set_rewards(load_set(spec, run.data), run.rewards, SetNaming.command(spec.name)) for spec in specs]


def test_a_humaneval_set_without_the_sandbox_names_its_own_option_which_then_resolves(tmp_path, monkeypatch):
    """rewards.terms[].params (the registry's own advice) does not reach a HumanEval set's reward:
    the refusal names set.NAME.reward_params.isolation=none, and with it the set's code_tests
    resolves outside the namespace sandbox with the format's other limits kept."""
    import megatron_rl.sandbox

    path = tmp_path / "he.jsonl"
    path.write_text(json.dumps(HUMANEVAL_ROW) + "\n")
    monkeypatch.setattr(megatron_rl.sandbox, "namespaces_available", lambda: "no user namespaces here (a test)")
    with pytest.raises(ConfigError) as refused:
        resolved([f"he={path}"])
    message = str(refused.value)
    assert message.startswith("set 'he': its reward code_tests runs the model's programs in a namespace sandbox, "
                              "which this machine cannot build: no user namespaces here (a test). Allow user "
                              "namespaces, or run them with resource limits only")
    assert message.endswith(": set.he.reward_params.isolation=none") and "rewards.terms" not in message
    (rewards,) = resolved([f"he={path}"], ["set.he.reward_params.isolation=none"])
    (term,) = rewards.terms
    assert (term.name, term.params) == ("code_tests", {**SANDBOX_PARAMS, "isolation": "none"})


def test_reward_params_without_a_reward_are_refused_not_ignored(tmp_path):
    path = tmp_path / "add.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(ConfigError, match=r"set 'add': reward_params are the parameters of the set's own reward, and "
                                          r"it names none: name it with set\.add\.reward=NAME"):
        resolved([f"add={path}"], ["set.add.reward_params.require_boxed=true"])
    (rewards,) = resolved([f"add={path}"], ["set.add.reward=math", "set.add.reward_params.require_boxed=true"])
    assert [(t.name, t.params) for t in rewards.terms] == [("math", {"require_boxed": True})]


def test_each_set_carries_its_own_n_and_k_and_a_set_without_them_the_commands(tmp_path):
    """A sets file's n and k (one greedy-ish sample, or 64 with ks of its own), set.NAME.k as the
    command line writes it, and --set NAME=PATH with the command's --n / --k."""
    path = tmp_path / "add.jsonl"
    sets = tmp_path / "sets.yaml"
    sets.write_text(f"quick: {{path: {path}, n: 1, k: [1]}}\nwide: {{path: {path}, n: 64, k: [64, 1, 8]}}\n")
    specs = parse_sets([f"plain={path}", f"own={path}"], str(sets), ["set.own.k=2,1"], SamplingDefaults(n=4, k=[1, 4]))
    assert [(s.name, s.n, s.k) for s in specs] == [("plain", 4, [1, 4]), ("own", 4, [1, 2]), ("quick", 1, [1]),
                                                  ("wide", 64, [1, 8, 64])]
    (alone,) = parse_sets([f"plain={path}"], None, ["set.plain.k=3"], SamplingDefaults())
    assert (alone.n, alone.k) == (8, [3])
    (default,) = parse_sets([f"plain={path}"], None, [], SamplingDefaults(n=16))
    assert (default.n, default.k) == (16, None)  # the report's default_ks(16)


@pytest.mark.parametrize("set_args,options,k,refusal", [
    (["quick=q.jsonl"], ["set.quick.n=1", "set.quick.k=1,4"], None,
     "set 'quick': set.quick.k 4 is more than n=1, the samples per prompt it draws from (pass@k and maj@k use k of "
     "the n samples): ask for k <= 1 (set.quick.k), or more samples (set.quick.n)"),
    (["quick=q.jsonl", "wide=w.jsonl"], ["set.quick.n=1", "set.wide.n=64"], [1, 4],
     "set 'quick': --k 4 is more than n=1, the samples per prompt it draws from (pass@k and maj@k use k of the n "
     "samples): ask for k <= 1 (--k for every set, set.quick.k for this one), or more samples (--n, or set.quick.n)"),
    (["quick=q.jsonl"], ["set.quick.k=0"], None, "set 'quick': set.quick.k 0 must be an integer from 1 to n=8"),
    (["quick=q.jsonl"], ["set.quick.k=1,two"], None,
     "set 'quick': k must be integers from 1 to n, e.g. [1, 4, 16] (set.NAME.k=1,4,16), got '1,two'"),
    (["quick=q.jsonl"], ["set.quick.k=[]"], None,
     "set 'quick': k must be integers from 1 to n, e.g. [1, 4, 16] (set.NAME.k=1,4,16), got []"),
])
def test_a_k_outside_a_sets_n_is_refused_naming_the_set_and_where_the_k_came_from(set_args, options, k, refusal):
    """Checked as the command line is parsed, before any file, checkpoint or engine is touched."""
    with pytest.raises(ConfigError) as refused:
        parse_sets(set_args, None, options, SamplingDefaults(k=k))
    assert str(refused.value) == refusal


def test_the_advice_for_a_set_without_answers_can_be_typed_on_the_command_line_and_in_a_sets_file(tmp_path):
    """`set.NAME.answer_key=null`, which the refusal advises, reads the set without reference
    answers. Before, the command line's value was the text "null" (a field of that name, missing
    again) and a --sets file's `answer_key: null` meant "the run's data.answer_key": the advice
    could not be followed for one set."""
    path = tmp_path / "open.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"say {i}"}) + "\n" for i in range(2)))
    data = load_config(None, []).data
    with pytest.raises(ConfigError, match=r"or set\.a\.answer_key=null for a set without answers"):
        load_set(parse_sets([f"a={path}"], None, [], SamplingDefaults())[0], data)
    sets = tmp_path / "sets.yaml"
    for options, sets_text in ((["set.a.answer_key=null"], None), ([], f"a: {{path: {path}, answer_key: null}}\n"),
                               ([], f"a: {{path: {path}, answer_key: ~}}\n")):
        if sets_text is not None:
            sets.write_text(sets_text)
        spec = parse_sets([] if sets_text else [f"a={path}"], str(sets) if sets_text else None, options,
                          SamplingDefaults())[0]
        loaded = load_set(spec, data)
        assert [(r.prompt, r.answer) for r in loaded.records] == [("say 0", None), ("say 1", None)], options
