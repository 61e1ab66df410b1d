"""rl.eval (config/evaluation.py): its values are checked when the config is loaded, each refusal
naming the key and the value; its schedule (`due`) is the start, the last step and every
every_steps (rl.eval_every when null), and nothing without sets."""

from __future__ import annotations

import pytest

from megatron_rl.config import load_config
from megatron_rl.config.evaluation import EvalConfig
from megatron_rl.errors import ConfigError


def test_rl_eval_is_read_from_the_command_line():
    config = load_config(None, ["rl.eval.sets.he=data/HumanEval.jsonl.gz", "rl.eval.sets.heldout=heldout",
                                "rl.eval.n=16", "rl.eval.k=[1,4,16]", "rl.eval.every_steps=10"])
    assert config.rl.eval == EvalConfig(sets={"he": "data/HumanEval.jsonl.gz", "heldout": "heldout"}, n=16,
                                        k=[1, 4, 16], every_steps=10)
    assert load_config(None, []).rl.eval == EvalConfig()  # off: no sets


@pytest.mark.parametrize("overrides,message", [
    (["rl.eval.n=4", "rl.eval.k=[1,8]"], r"rl\.eval\.k: 8 is more than rl\.eval\.n=4, the samples per prompt pass@8 "
                                         r"draws from; ask for k <= 4 or raise rl\.eval\.n"),
    (["rl.eval.k=[0]"], r"rl\.eval\.k: 0 must be an integer from 1 to n=8"),
    (["rl.eval.k=[]"], r"rl\.eval\.k is an empty list"),
    (["rl.eval.n=0"], r"rl\.eval\.n must be >= 1, got 0"),
    (["rl.eval.n=5000"], r"rl\.eval\.n must be at most 1024"),
    (["rl.eval.every_steps=-1"], r"rl\.eval\.every_steps must be >= 0 .* got -1"),
    (["rl.eval.temperature=-0.5"], r"rl\.eval\.temperature must be a finite number >= 0 \(0: greedy\), got -0\.5"),
    (["rl.eval.temperature=.inf"], r"rl\.eval\.temperature must be a finite number"),
    (["rl.eval.top_p=0"], r"rl\.eval\.top_p must be in \(0, 1\], got 0"),
    (["rl.eval.top_p=1.5"], r"rl\.eval\.top_p must be in \(0, 1\], got 1\.5"),
    (["rl.eval.prompts=0"], r"rl\.eval\.prompts must be >= 1 or null, got 0"),
    (["rl.eval.sets={'a/b': x.jsonl}"], r"rl\.eval\.sets: set name 'a/b' must be letters, digits"),
    (["rl.eval.sets.he= "], r"rl\.eval\.sets\.he: expected a path \(or 'heldout'\)"),
    (["rl.eval.step=3"], r"unknown key 'rl\.eval\.step'"),
])
def test_bad_rl_eval_values_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_the_sets_run_at_the_start_the_end_and_every_steps():
    def due(config, eval_every=25, last=10):
        return [step for step in range(last + 1) if config.due(step, last, eval_every)]

    assert due(EvalConfig()) == []  # no sets: never
    sets = {"heldout": "heldout"}
    assert due(EvalConfig(sets=sets, every_steps=4)) == [0, 4, 8, 10]
    assert due(EvalConfig(sets=sets), eval_every=3) == [0, 3, 6, 9, 10]  # null: rl.eval_every's
    assert due(EvalConfig(sets=sets, every_steps=0), eval_every=3) == [0, 10]
