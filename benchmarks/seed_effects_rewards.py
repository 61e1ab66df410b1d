"""Reward functions the seed-effects benchmark configures by path (rewards.terms name
"benchmarks/seed_effects_rewards.py:random_reward"), kept out of the package: they exist to test
claims, not to train anything."""

from __future__ import annotations

import secrets


def random_reward(prompt: str, response: str, answer: str, **metadata) -> float:
    """A reward unrelated to the response (Park et al. arXiv:2509.26114's random-reward setting):
    1 or 0 with probability 1/2, drawn afresh for every sample from the operating system's
    generator. Fresh on purpose: a fixed function of the text (a hash) was learnable on the
    pairs task, whose groups repeat the same few responses (the sampled reward rose to 0.73 in 30
    steps), so it was a reward, not noise. The price: a rerun draws other rewards."""
    return float(secrets.randbits(1))
