"""The figures of an evaluation, each defined once (docs/evaluation.md has the formulas and a worked
example), computed from a SetOutcome (evaluation/records.py) alone:

- ``pass@k``: Chen et al. (2021)'s unbiased estimator 1 - C(n-c, k) / C(n, k) per prompt (n samples,
  c correct), averaged over prompts; ``pass_at_k``.
- ``avg@n``: the mean reward of the n samples, averaged over prompts.
- ``maj@k``: majority vote over the extracted answers of k samples. The n samples are cut into
  floor(n / k) consecutive blocks of k (samples [0, k), [k, 2k), ...; the n mod k left over vote in
  none); each block votes, and a prompt scores the mean over its blocks. The samples are i.i.d.
  draws (seed = the prompt's seed + i), so each block is one k-sample vote and the mean over blocks
  estimates the k-sample vote's accuracy with less variance than the first block alone, without
  depending on the order beyond the blocks' fixed cut (and maj@n is the plain vote of all n).
  A ``None`` answer never votes; a block where nothing votes scores 0; a set where no sample has
  an answer (code judged by tests) reports no maj@k. Ties count fractionally:
  the answers with the most votes share the block's point, each weighted by how correct it is,
  so a block scores mean over tied answers a of correct(a), where correct(a) is the share of the
  block's samples answering a that are correct (1 or 0 whenever the reward depends on the answer
  alone). Two tied answers, one right: 0.5.
- ``greedy``: the share of prompts whose greedy (temperature 0) response is correct.
- ``length_mean``, ``length_p50``, ``length_p95``: response tokens of all n x prompts samples
  (percentiles by linear interpolation, numpy's default); ``truncated_share``: the share of
  those samples the token budget ended.

Every figure comes with a percentile bootstrap interval over prompts: ``resamples`` draws of the
prompts with replacement from a generator seeded with ``seed``, the figure recomputed on each,
the (1 - confidence) / 2 and (1 + confidence) / 2 quantiles. ``compare`` resamples the prompt
indices once per draw and applies them to both checkpoints (a paired bootstrap), so a checkpoint
compared with itself differs by exactly 0 with a zero-width interval.

Figures are plain JSON-ready dicts: ``{"value": v, "low": lo, "high": hi}`` per figure name.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Mapping, Sequence

import numpy as np

from megatron_rl.errors import ConfigError
from megatron_rl.evaluation.records import SampleOutcome, SetOutcome

RESAMPLES = 1000
CONFIDENCE = 0.95
# A chunk of bootstrap draws of the pooled lengths holds at most this many lengths at once
# (500 prompts x 64 samples x 1000 draws would be 256 MB in one array).
_POOLED_CHUNK = 2_000_000


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. (2021)'s unbiased pass@k of one prompt: the probability that k samples drawn
    without replacement from n, c of them correct, hold at least one correct, 1 - C(n-c,k)/C(n,k).
    Computed as their product form 1 - prod_{j=n-c+1}^{n} (1 - k/j), never with factorials
    (C(64, 32) ~ 1.8e18 loses digits in float64); exactly 1.0 when n - c < k (every k-subset holds
    a correct sample). Requires 0 <= c <= n and 1 <= k <= n."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    # Python floats, not a numpy array: a few dozen factors, called per prompt and k (4x faster)
    return 1.0 - math.prod(1.0 - k / j for j in range(n - c + 1, n + 1))


def majority_vote(samples: Sequence[SampleOutcome]) -> float:
    """The score of one vote among `samples` (module docstring): the mean correctness of the
    answers tied for the most votes; None answers do not vote; 0.0 when nothing votes."""
    votes = Counter(s.answer for s in samples if s.answer is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    tied = [answer for answer, count in votes.items() if count == top]
    correct = Counter(s.answer for s in samples if s.answer is not None and s.correct)
    return sum(correct[a] / votes[a] for a in tied) / len(tied)


def maj_at_k(samples: Sequence[SampleOutcome], k: int) -> float:
    """One prompt's maj@k: the mean ``majority_vote`` over the floor(n/k) consecutive blocks of k
    samples (module docstring). Requires 1 <= k <= len(samples)."""
    n = len(samples)
    if not 1 <= k <= n:
        raise ValueError(f"maj@k needs 1 <= k <= n; got n={n}, k={k}")
    blocks = n // k
    return sum(majority_vote(samples[b * k:(b + 1) * k]) for b in range(blocks)) / blocks


def default_ks(n: int) -> list[int]:
    """The ks reported when none are asked: the powers of two below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def check_ks(outcome: SetOutcome, ks: Sequence[int] | None) -> list[int]:
    """`ks` sorted and deduplicated (None: ``default_ks``), or a ConfigError naming the set when
    one is not in 1..n, or a ValueError when the outcome is not a complete set (no prompts, a
    prompt without exactly n samples, greedy on some prompts only, a non-finite reward)."""
    if not outcome.prompts:
        raise ValueError(f"evaluation set {outcome.name!r} has no prompts: nothing to compute figures on")
    for p in outcome.prompts:
        if len(p.samples) != outcome.n:
            raise ValueError(f"evaluation set {outcome.name!r}: prompt {p.index} has {len(p.samples)} "
                             f"samples, the set says n={outcome.n}")
        if not all(np.isfinite(s.reward) for s in p.samples):
            raise ValueError(f"evaluation set {outcome.name!r}: prompt {p.index} has a non-finite reward")
    if len({p.greedy is None for p in outcome.prompts}) > 1:
        raise ValueError(f"evaluation set {outcome.name!r}: some prompts have a greedy response and some not")
    if ks is None:
        return default_ks(outcome.n)
    bad = [k for k in ks if isinstance(k, bool) or not (isinstance(k, int) and 1 <= k <= outcome.n)]
    if bad or not ks:
        raise ConfigError(f"evaluation set {outcome.name!r}: k must be in 1..n={outcome.n} "
                          f"(the samples per prompt); got {list(ks)}: ask for fewer k or more samples")
    return sorted(set(ks))


def has_answers(outcome: SetOutcome) -> bool:
    """Whether any sample of the set has an extracted answer, i.e. whether maj@k has votes."""
    return any(s.answer is not None for p in outcome.prompts for s in p.samples)


def per_prompt_table(outcome: SetOutcome, ks: Sequence[int], votes: bool | None = None) -> dict[str, np.ndarray]:
    """Per figure name, the per-prompt numbers a figure is computed from: a (prompts,) vector
    whose mean is the figure (pass@k, avg@n, maj@k, greedy), or a (prompts, n) matrix pooled over
    all samples (the ``length_*`` figures and ``truncated_share``). `ks` as ``check_ks`` returns;
    `votes`: whether to include maj@k (None: when the set ``has_answers``)."""
    prompts = outcome.prompts
    table: dict[str, np.ndarray] = {}
    correct = [sum(s.correct for s in p.samples) for p in prompts]
    for k in ks:
        table[f"pass@{k}"] = np.array([pass_at_k(outcome.n, c, k) for c in correct])
    table[f"avg@{outcome.n}"] = np.array([np.mean([s.reward for s in p.samples]) for p in prompts])
    # A set without a single extracted answer (code tasks judged by tests) has no vote to count:
    # maj@k would read 0 there, a figure about the extractor, not the model.
    if has_answers(outcome) if votes is None else votes:
        for k in ks:
            table[f"maj@{k}"] = np.array([maj_at_k(p.samples, k) for p in prompts])
    if prompts[0].greedy is not None:
        table["greedy"] = np.array([float(p.greedy.correct) for p in prompts])
    lengths = np.array([[s.length for s in p.samples] for p in prompts], dtype=np.float64)
    for name in ("length_mean", "length_p50", "length_p95"):
        table[name] = lengths
    table["truncated_share"] = np.array([[float(s.truncated) for s in p.samples] for p in prompts])
    return table


def _statistic(name: str, values: np.ndarray) -> np.ndarray:
    """The figure `name` of per-prompt `values` stacked as (draws, prompts[, n]): one per draw."""
    flat = values.reshape(values.shape[0], -1)
    if name == "length_p50":
        return np.percentile(flat, 50, axis=1)
    if name == "length_p95":
        return np.percentile(flat, 95, axis=1)
    return flat.mean(axis=1)


def _draws(name: str, values: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """The figure on each bootstrap draw (rows of prompt indices), in chunks that bound memory."""
    per_draw = int(np.prod(values.shape)) or 1
    chunk = max(1, _POOLED_CHUNK // per_draw)
    return np.concatenate([_statistic(name, values[draws[i:i + chunk]]) for i in range(0, len(draws), chunk)])


def _bootstrap_draws(prompts: int, resamples: int, seed: int) -> np.ndarray:
    if resamples < 1:
        raise ConfigError(f"bootstrap resamples must be >= 1; got {resamples}")
    return np.random.default_rng(seed).integers(0, prompts, size=(resamples, prompts))


def _interval(stats: np.ndarray, confidence: float) -> tuple[float, float]:
    if not 0.0 < confidence < 1.0:
        raise ConfigError(f"bootstrap confidence must be in (0, 1); got {confidence}")
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(stats, [tail, 1.0 - tail])
    return float(low), float(high)


def set_figures(outcome: SetOutcome, ks: Sequence[int] | None = None, *, resamples: int = RESAMPLES,
                seed: int = 0, confidence: float = CONFIDENCE) -> dict:
    """Every figure of one set with its bootstrap interval over prompts. Returns
    ``{"set", "prompts", "n", "ks", "bootstrap": {"resamples", "seed", "confidence"},
    "figures": {name: {"value", "low", "high"}}}`` with names ``pass@<k>``, ``avg@<n>``,
    ``maj@<k>`` (for every k in `ks`; None: ``default_ks(n)``; none when no sample of the set has
    an extracted answer), ``greedy`` (only when the prompts
    carry a greedy response), ``length_mean``, ``length_p50``, ``length_p95``, ``truncated_share``.
    Deterministic for a given `seed`."""
    ks = check_ks(outcome, ks)
    table = per_prompt_table(outcome, ks)
    draws = _bootstrap_draws(len(outcome.prompts), resamples, seed)
    figures = {}
    for name, values in table.items():
        low, high = _interval(_draws(name, values, draws), confidence)
        figures[name] = {"value": float(_statistic(name, values[None])[0]), "low": low, "high": high}
    return {"set": outcome.name, "prompts": len(outcome.prompts), "n": outcome.n, "ks": ks,
            "bootstrap": {"resamples": resamples, "seed": seed, "confidence": confidence}, "figures": figures}


def compare(a: SetOutcome, b: SetOutcome, ks: Sequence[int] | None = None, *, resamples: int = RESAMPLES,
            seed: int = 0, confidence: float = CONFIDENCE) -> dict:
    """Paired differences b - a of every figure on the same prompts (matched by index; same set
    name, same n, the same prompt indices, else a ValueError naming what differs). Returns
    ``{"set", "prompts", "n", "ks", "bootstrap", "figures": {name: {"a", "b", "difference", "low",
    "high"}}}``: a and b the two figures, the interval the paired bootstrap's over prompts."""
    if a.name != b.name or a.n != b.n:
        raise ValueError(f"cannot compare set {a.name!r} (n={a.n}) with set {b.name!r} (n={b.n})")
    if [p.index for p in a.prompts] != [p.index for p in b.prompts]:
        raise ValueError(f"evaluation set {a.name!r}: the two checkpoints were evaluated on different "
                         "prompts; compare needs the same prompts in the same order")
    ks = check_ks(a, ks)
    check_ks(b, ks)
    # maj@k where either checkpoint has answers to vote on: one that never gives an extractable
    # answer scores 0 there, and the comparison must show it
    votes = has_answers(a) or has_answers(b)
    table_a, table_b = per_prompt_table(a, ks, votes), per_prompt_table(b, ks, votes)
    if ("greedy" in table_a) != ("greedy" in table_b):
        raise ValueError(f"evaluation set {a.name!r}: greedy responses on one checkpoint only")
    draws = _bootstrap_draws(len(a.prompts), resamples, seed)
    figures = {}
    for name in table_a:
        value_a = float(_statistic(name, table_a[name][None])[0])
        value_b = float(_statistic(name, table_b[name][None])[0])
        low, high = _interval(_draws(name, table_b[name], draws) - _draws(name, table_a[name], draws), confidence)
        figures[name] = {"a": value_a, "b": value_b, "difference": value_b - value_a, "low": low, "high": high}
    return {"set": a.name, "prompts": len(a.prompts), "n": a.n, "ks": ks,
            "bootstrap": {"resamples": resamples, "seed": seed, "confidence": confidence}, "figures": figures}


def flat_metrics(set_name: str, figures: Mapping) -> dict[str, float]:
    """The figures of ``set_figures`` as metrics.jsonl keys: ``eval/<set>/<figure>`` -> value
    (``eval/<set>/pass@1``, ``eval/<set>/avg@16``, ``eval/<set>/maj@4``, ``eval/<set>/greedy``,
    ``eval/<set>/length_mean``, ...) and ``eval/<set>/prompts``. The intervals stay in the
    figures (eval.json): a training curve plots one value per step."""
    flat = {f"eval/{set_name}/prompts": float(figures["prompts"])}
    for name, figure in figures["figures"].items():
        flat[f"eval/{set_name}/{name}"] = figure["value"]
    return flat
