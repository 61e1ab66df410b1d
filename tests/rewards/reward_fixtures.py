"""Reward functions the scoring and registry tests load by import path ("reward_fixtures:...")."""

import os


def exact(prompt, response, answer, **metadata):
    return float(response.strip() == answer)


def hang_on_request(prompt, response, answer, **metadata):
    # A pure-Python busy loop: only killing the process stops it.
    if response == "hang":
        while True:
            pass
    return 1.0


def raise_on_request(prompt, response, answer, **metadata):
    if response == "raise":
        raise ZeroDivisionError("asked to fail")
    return 1.0


def exit_process(prompt, response, answer, **metadata):
    os._exit(7)


def returns_text(prompt, response, answer, **metadata):
    return "1.0"


def returns_nan(prompt, response, answer, **metadata):
    return float("nan")


def returns_huge(prompt, response, answer, sign=1.0, **metadata):
    """Finite, but a group of such rewards has an infinite mean: the advantages would be NaN."""
    return sign * 1e308


def scaled_length(prompt, response, answer, scale=1.0, **metadata):
    return len(response) * scale


def echo_metadata(prompt, response, answer, bonus=0.0, **metadata):
    return bonus


NOT_CALLABLE = 42


class Judge:
    @staticmethod
    def score(prompt, response, answer, **metadata):
        return 0.5
