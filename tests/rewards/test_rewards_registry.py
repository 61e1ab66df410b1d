"""Reward names -> functions: built-ins, import paths, file paths, and the errors for each."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.errors import ConfigError
from megatron_rl.rewards.math_answer import math_verify_available
from megatron_rl.rewards.registry import BUILTIN_REWARDS, resolve_reward

HERE = Path(__file__).parent


def test_builtins_resolve_and_declare_isolation():
    assert resolve_reward("synthetic").inline_safe
    assert resolve_reward("synthetic:add").inline_safe
    assert resolve_reward("format").inline_safe
    assert not resolve_reward("format", {"pattern": ".*"}).inline_safe  # regexes can backtrack
    if math_verify_available():
        math = resolve_reward("math")
        assert not math.inline_safe and math.fast_path is not None and math.prepare is not None
    pure = resolve_reward("math", {"use_math_verify": False})  # no sympy: pure Python, inline
    assert pure.inline_safe and pure.fn("q", r"\boxed{\sqrt{2}}", r"\sqrt 2") == 0.0
    assert set(BUILTIN_REWARDS) >= {"math", "format", "synthetic", "synthetic:sort"}


def test_builtin_rewards_score():
    assert resolve_reward("math").fn("q", r"\boxed{0.5}", r"\frac12") == 1.0
    assert resolve_reward("synthetic:add").fn("1+2=", "3", "3") == 1.0
    assert resolve_reward("synthetic:add", {"response_format": "boxed"}).fn("1+2=", r"\boxed{3}", "3") == 1.0
    synthetic = resolve_reward("synthetic").fn
    assert synthetic("sort 21=", r"\boxed{12}", "12", task="sort", response_format="boxed") == 1.0
    assert synthetic("sort 21=", "21", "12", task="sort") == 0.0
    with pytest.raises(ValueError, match="task"):
        synthetic("p", "r", "a")


def test_a_records_metadata_cannot_set_a_builtin_rewards_params():
    """A row field named like a param (math's require_boxed) is dropped: the configured value, or
    the default when none is configured, grades the sample; the full check and the fast path alike."""
    for params in ({}, {"use_math_verify": False}):
        math = resolve_reward("math", params)
        assert math.fn("q", "the answer is 4", "4", require_boxed=True) == 1.0
        if math.fast_path is not None:
            assert math.fast_path("q", "the answer is 4", "4", require_boxed=True) == 1.0
    boxed = resolve_reward("math", {"require_boxed": True})
    assert boxed.fn("q", "the answer is 4", "4", require_boxed=False) == 0.0


def test_import_path_resolves_functions_and_attributes():
    assert resolve_reward("reward_fixtures:exact").fn("q", " 5 ", "5") == 1.0
    assert resolve_reward("reward_fixtures:Judge.score").fn("q", "r", "a") == 0.5
    assert not resolve_reward("reward_fixtures:exact").inline_safe


def test_params_are_passed_and_win_over_metadata():
    fn = resolve_reward("reward_fixtures:echo_metadata", {"bonus": 2.0}).fn
    assert fn("q", "r", "a", bonus=5.0, other=1) == 2.0
    assert resolve_reward("reward_fixtures:scaled_length", {"scale": 0.5}).fn("q", "abcd", "a") == 2.0


def test_file_path_resolves(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def score(prompt, response, answer, **kw):\n    return 0.25\n")
    assert resolve_reward(f"{path}:score").fn("q", "r", "a") == 0.25


@pytest.mark.parametrize(
    "name, message",
    [
        ("no_such_module_xyz:fn", r"reward 'no_such_module_xyz:fn': no module named 'no_such_module_xyz'"),
        ("reward_fixtures.sub:fn", r"no module named 'reward_fixtures.sub'"),
        ("broken_reward_module:fn", r"importing 'broken_reward_module' failed: RuntimeError: this module is broken"),
        ("reward_fixtures:missing", r"'reward_fixtures' has no attribute 'missing'"),
        ("reward_fixtures:Judge.nope", r"has no attribute 'nope'"),
        ("reward_fixtures:NOT_CALLABLE",
         r"reward 'reward_fixtures:NOT_CALLABLE' is not callable \(it is an object of type int\)"),
        ("just_a_name", r"neither a built-in .* nor an import path"),
        ("module:", r"neither a built-in"),
        ("/no/such/file.py:fn", r"file /no/such/file.py does not exist"),
        ("synthetic:divide", r"unknown synthetic task"),
        ("", r"non-empty string"),
    ],
)
def test_resolution_errors_name_the_reward_and_the_problem(name, message):
    with pytest.raises(ConfigError, match=message):
        resolve_reward(name)


def test_file_that_fails_to_execute(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("import no_such_dependency_xyz\n")
    with pytest.raises(ConfigError, match=r"executing .*bad.py failed: ModuleNotFoundError"):
        resolve_reward(f"{path}:fn")


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("math", {"strict": True}, r"unknown parameter 'strict' \(known: require_boxed, use_math_verify\)"),
        ("math", {"require_boxed": "yes"}, r"require_boxed must be true or false"),
        ("format", {"pattern": "("}, r"not a valid regular expression"),
        ("synthetic", {"digits": 2}, r"unknown parameter 'digits' \(known: none\)"),
        ("synthetic:add", {"response_format": "json"}, r"response_format"),
    ],
)
def test_builtin_parameter_errors(name, params, message):
    with pytest.raises(ConfigError, match=message):
        resolve_reward(name, params)
