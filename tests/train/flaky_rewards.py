"""A user reward function that fails on purpose: it raises for some responses and hangs for others."""

import time


def raises_on_sevens(prompt: str, response: str, answer: str | None, **metadata) -> float:
    if "7" in response:
        raise RuntimeError("this reward function does not like sevens")
    # Longer than the configured timeout: must score 0 and be counted. Only for some prompts: each
    # hang costs the run its timeout and a worker restart (with every "3" it was 35 s per step).
    if "3" in response and "9" in prompt:
        time.sleep(60)
    return float(response.strip() == (answer or "").strip())


def always_raises(prompt: str, response: str, answer: str | None, **metadata) -> float:
    raise KeyError("answer_field")  # e.g. a reward function reading a dataset column that is not there
