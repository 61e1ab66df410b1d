"""A user reward function that fails on purpose: it raises for some responses and hangs for others."""

import time


def raises_on_sevens(prompt: str, response: str, answer: str | None, **metadata) -> float:
    if "7" in response:
        raise RuntimeError("this reward function does not like sevens")
    if "3" in response:
        time.sleep(60)  # longer than the configured timeout: must score 0 and be counted
    return float(response.strip() == (answer or "").strip())


def always_raises(prompt: str, response: str, answer: str | None, **metadata) -> float:
    raise KeyError("answer_field")  # e.g. a reward function reading a dataset column that is not there
