"""Combining per-micro-batch metrics into step metrics, and the length-bias diagnostic.

``policy_loss`` returns metrics that can be combined EXACTLY across micro-batches and ranks:
sums, maxima and minima, never means (a mean of per-micro-batch means weights tokens by the
split, the same bug as a per-micro-batch token-mean loss). The key suffix says how a value
combines and what it becomes:

================= ======= ==================================================
suffix            combine step value (key without the suffix)
================= ======= ==================================================
``/sum``          sum     the sum (losses, counts)
``/tok_sum``      sum     sum / ``count/tokens`` (token mean)
``/seq_sum``      sum     sum / ``count/sequences`` (sequence mean)
``/sub_tok_sum``  sum     sum / ``<parent>/tokens``: the token mean over a
                          sub-population (``a/b/x/sub_tok_sum`` is divided by
                          the step's ``a/b/tokens/sum``)
``/sub_seq_sum``  sum     sum / ``<parent>/sequences``: the same per sample
``/max``          max     the max
``/min``          min     the min
================= ======= ==================================================

So the trainer keeps the dicts of a step's micro-batches and calls
``reduce_metrics(dicts, group=dp_group)`` once: one collective (an all_gather of one small
vector) gives every rank the same step-level numbers. A statistic without data (a mean over
zero tokens, the max of nothing) is left out of the result rather than reported as NaN/inf.
"""

from __future__ import annotations

import zlib
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from megatron_rl.algorithms._checks import finite_number

__all__ = ["METRIC_SUFFIXES", "reduce_metrics", "length_bias_metrics"]

METRIC_SUFFIXES = ("/sub_tok_sum", "/sub_seq_sum", "/sum", "/tok_sum", "/seq_sum", "/max", "/min")
_SUM_KINDS = ("/sum", "/tok_sum", "/seq_sum", "/sub_tok_sum", "/sub_seq_sum")


def _split(key: str) -> tuple[str, str]:
    for suffix in METRIC_SUFFIXES:
        if key.endswith(suffix) and len(key) > len(suffix):
            return key[: -len(suffix)], suffix
    raise ValueError(f"metric key {key!r} has no combine suffix (one of {METRIC_SUFFIXES})")


def _value(v, device) -> torch.Tensor:
    if torch.is_tensor(v):
        if v.numel() != 1:
            raise ValueError(f"metric values must be scalars, got shape {tuple(v.shape)}")
        return v.detach().reshape(()).to(device=device, dtype=torch.float64)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return torch.tensor(float(v), dtype=torch.float64, device=device)
    raise ValueError(f"metric values must be numbers or 0-d tensors, got {type(v).__name__}")


def reduce_metrics(
    metric_dicts: Sequence[Mapping[str, torch.Tensor | float]] | Mapping[str, torch.Tensor | float],
    group=None,
    *,
    device: torch.device | str | None = None,
) -> dict[str, float]:
    """Combine a step's per-micro-batch metric dicts (this rank's) over ``group`` into floats.

    Args:
        metric_dicts: the dicts returned by ``policy_loss`` for each micro-batch of the step
            (or one dict). Keys must carry a combine suffix (module docstring).
        group: the DP (x CP) group; None = no communication. Every rank must pass the same set
            of keys (checked with a checksum, travelling in the same collective).
        device: device for the collective (NCCL needs CUDA); default: that of the first tensor.

    Returns:
        ``{name: float}`` step values: sums, token/sequence means, max, min. ``count/tokens``
        and ``count/sequences`` are included when present.
    """
    if isinstance(metric_dicts, Mapping):
        metric_dicts = [metric_dicts]
    keys = sorted({k for md in metric_dicts for k in md})
    kinds = {k: _split(k) for k in keys}
    names: dict[str, str] = {}
    for k, (name, _) in kinds.items():
        if name in names:
            raise ValueError(f"metric keys {names[name]!r} and {k!r} both map to {name!r}")
        names[name] = k
    if device is None:
        tensors = (v for md in metric_dicts for v in md.values() if torch.is_tensor(v))
        device = next((v.device for v in tensors), torch.device("cpu"))
    # Combine this rank's micro-batches, then pack one vector for the collective: sums as they
    # are, maxima as they are, minima negated, so every entry reduces with either sum or max.
    columns = []
    for k in keys:
        suffix = kinds[k][1]
        vals = torch.stack([_value(md[k], device) for md in metric_dicts if k in md])
        if suffix in _SUM_KINDS:
            columns.append(vals.sum())
        elif suffix == "/max":
            columns.append(vals.max())
        else:
            columns.append(-vals.min())
    checksum = float(zlib.crc32("\n".join(keys).encode()))  # same keys on every rank?
    packed = torch.stack(columns + [torch.tensor(checksum, dtype=torch.float64, device=device)])
    world = dist.get_world_size(group) if group is not None else 1
    if world > 1:
        gathered = [torch.empty_like(packed) for _ in range(world)]
        dist.all_gather(gathered, packed, group=group)
        table = torch.stack(gathered)
        if not bool((table[:, -1] == checksum).all()):
            raise ValueError("ranks passed different metric keys to reduce_metrics (checksum mismatch)")
        is_sum = torch.tensor([kinds[k][1] in _SUM_KINDS for k in keys] + [False], device=device)
        reduced = torch.where(is_sum, table.sum(0), table.max(0).values)
    else:
        reduced = packed
    values = dict(zip(keys, reduced[:-1].tolist()))

    totals = {"/tok_sum": values.get("count/tokens/sum"), "/seq_sum": values.get("count/sequences/sum")}
    out: dict[str, float] = {}
    for k in keys:
        name, suffix = kinds[k]
        v = values[k]
        if suffix == "/sum":
            out[name] = v
        elif suffix in ("/sub_tok_sum", "/sub_seq_sum"):
            parent = name.rpartition("/")[0]
            count = f"{parent}/{'tokens' if suffix == '/sub_tok_sum' else 'sequences'}/sum"
            if count not in values:
                raise ValueError(f"metric {k!r} needs {count!r} in the same dicts")
            if values[count] > 0:
                out[name] = v / values[count]
        elif suffix in totals:
            denom = totals[suffix]
            if denom is None:
                need = "count/tokens/sum" if suffix == "/tok_sum" else "count/sequences/sum"
                raise ValueError(f"metric {k!r} needs {need!r} in the same dicts")
            if denom > 0:
                out[name] = v / denom
        elif suffix == "/max":
            if v != float("-inf"):
                out[name] = v
        else:  # /min, stored negated
            if v != float("-inf"):
                out[name] = -v
    return out


def length_bias_metrics(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    *,
    correct_threshold: float = 0.5,
) -> dict[str, float]:
    """Response length of correct vs wrong samples: the length-bias diagnostic.

    Dr. GRPO (arXiv:2503.20783 §3.1, Fig. 5) shows that GRPO's per-sample 1/|o_i| weighting
    makes WRONG responses grow longer while correct ones do not; a widening
    ``length/wrong_minus_correct`` over training is that bias at work.

    Args:
        rewards: ``[groups, G]`` (or flat ``[batch]``) rewards; a sample is correct when its
            reward is >= ``correct_threshold`` (shaped rewards such as 1.1 for correct +
            format and 0.1 for format only work with the default 0.5).
        lengths: response lengths, same shape.

    Returns (keys with no data are left out): ``length/mean``, ``length/correct_mean``,
    ``length/wrong_mean``, ``length/wrong_minus_correct``, ``count/correct``, ``count/wrong``,
    and for 2-D input ``length/wrong_minus_correct_in_group`` (the mean over groups that have
    both kinds of the within-group difference, which controls for prompt difficulty) and
    ``count/mixed_groups``.
    """
    if not torch.is_tensor(rewards) or rewards.dim() not in (1, 2):
        got = getattr(rewards, "shape", type(rewards).__name__)
        raise ValueError(f"rewards must be [groups, G] or [batch], got {got}")
    if not torch.is_tensor(lengths) or tuple(lengths.shape) != tuple(rewards.shape):
        got = tuple(getattr(lengths, "shape", ()))
        raise ValueError(f"lengths shape {got} must equal rewards shape {tuple(rewards.shape)}")
    finite_number(correct_threshold, "correct_threshold")
    r = rewards.detach().to(torch.float64)
    n = lengths.detach().to(torch.float64)
    if r.numel() and not bool(torch.isfinite(r).all()):
        raise ValueError("rewards contain NaN/inf")
    correct = r >= correct_threshold
    out: dict[str, float] = {"count/correct": float(correct.sum()), "count/wrong": float((~correct).sum())}
    if n.numel():
        out["length/mean"] = float(n.mean())
    if correct.any():
        out["length/correct_mean"] = float(n[correct].mean())
    if (~correct).any():
        out["length/wrong_mean"] = float(n[~correct].mean())
    if "length/correct_mean" in out and "length/wrong_mean" in out:
        out["length/wrong_minus_correct"] = out["length/wrong_mean"] - out["length/correct_mean"]
    if r.dim() == 2:
        c = correct.to(torch.float64)
        n_c, n_w = c.sum(1), (1 - c).sum(1)
        mixed = (n_c > 0) & (n_w > 0)
        out["count/mixed_groups"] = float(mixed.sum())
        if mixed.any():
            mean_c = (n * c).sum(1)[mixed] / n_c[mixed]
            mean_w = (n * (1 - c)).sum(1)[mixed] / n_w[mixed]
            out["length/wrong_minus_correct_in_group"] = float((mean_w - mean_c).mean())
    return out
