"""Batched reward functions the batched-scoring tests load by import path ("batched_reward_fixtures:...")."""

import os

from megatron_rl.rewards import batched


def graded(prompt, response, answer, scale=1.0, level=None, **metadata):
    """Per-sample reference: exact match, plus the response length times ``scale``, plus ``level``."""
    return float(response == answer) + len(response) * scale + (level or 0)


def graded_batch(prompts, responses, answers, scale=1.0, level=None, **columns):
    """``graded`` over lists; detected as batched by its first parameter's name."""
    levels = level if level is not None else [None] * len(prompts)
    return [graded(p, r, a, scale=scale, level=lv) for p, r, a, lv in zip(prompts, responses, answers, levels)]


@batched
def graded_marked(ps, rs, ans, **columns):
    """``graded`` over lists, declared by the decorator (the parameter names say nothing)."""
    return graded_batch(ps, rs, ans, **columns)


def graded_declared(ps, rs, ans, **columns):
    """``graded`` over lists, undetectable: only the term's ``batched: true`` makes it batched."""
    return graded_batch(ps, rs, ans, **columns)


def call_size(prompts, responses, answers, **columns):
    """Every sample's reward is the number of samples in its call (shows how a batch was chunked)."""
    return [len(prompts)] * len(prompts)


def column_echo(prompts, responses, answers, tag=None, mode="plain", **columns):
    """1.0 where the sample's ``tag`` column is set; a scalar ``mode`` param must arrive as is."""
    assert isinstance(mode, str), f"params must arrive as plain values, got {mode!r}"
    assert isinstance(tag, list) and len(tag) == len(prompts), "columns must be lists, one value per sample"
    return [float(t is not None) + (mode == "bonus") for t in tag]


def misbehave(prompts, responses, answers, **columns):
    """Fails as a whole when any response asks for it; a "nan" response spoils only its own element."""
    if "raise" in responses:
        raise ZeroDivisionError("asked to fail")
    if "hang" in responses:
        while True:  # a pure-Python busy loop: only killing the process stops it
            pass
    if "crash" in responses:
        os._exit(7)
    if "short" in responses:
        return [1.0] * (len(responses) - 1)
    if "text" in responses:
        return "1.0"
    return [float("nan") if r == "nan" else 1.0 for r in responses]


def prompts_per_sample(prompts, response, answer, **metadata):
    """Named like a batched function but meant per-sample: the term says ``batched: false``."""
    return float(isinstance(prompts, str))
