"""Format rewards: one boxed answer at the end, or a configured regular expression."""

from __future__ import annotations

import pytest

from megatron_rl.errors import ConfigError
from megatron_rl.rewards.format import ends_with_one_boxed, make_format_reward


@pytest.mark.parametrize(
    "response, want",
    [
        (r"so the answer is \boxed{5}", True),
        (r"\boxed{5}.", True),
        (r"$\boxed{\frac{1}{2}}$", True),
        ("\\[\\boxed{5}\\]\n", True),
        (r"\boxed{5} because reasons", False),  # text after the answer
        (r"\boxed{1} or \boxed{2}", False),  # two answers
        (r"\boxed{5", False),  # unfinished
        ("5", False),
    ],
)
def test_ends_with_one_boxed(response, want):
    assert ends_with_one_boxed(response) is want


def test_boxed_format_reward_value():
    reward = make_format_reward(value=0.2)
    assert reward("q", r"\boxed{5}", "5") == 0.2
    assert reward("q", "5", "5") == 0.0


def test_pattern_format_reward_matches_whole_response():
    reward = make_format_reward(pattern=r"<think>.*</think>\s*<answer>.*</answer>")
    assert reward("q", "<think>a\nb</think>\n<answer>5</answer>", None) == 1.0  # DOTALL: spans lines
    assert reward("q", "<answer>5</answer>", None) == 0.0
    assert reward("q", "<think></think><answer>5</answer> trailing", None) == 0.0  # full match


def test_format_reward_config_errors():
    with pytest.raises(ConfigError, match="not a valid regular expression"):
        make_format_reward(pattern="(unclosed")
    with pytest.raises(ConfigError, match="value must be a number"):
        make_format_reward(value="high")


def test_boxed_check_is_linear_on_adversarial_text():
    import time

    text = r"\boxed{1}" + " ." * 200_000 + "x"
    start = time.perf_counter()
    assert not ends_with_one_boxed(text)
    assert time.perf_counter() - start < 0.5
