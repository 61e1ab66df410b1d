"""Packed (thd) per-token values -> the padded ``[samples, max_len]`` layout the loss expects.

The policy packs several samples into one row (``PackedBatch``, cu_seqlens), but per-sample
quantities (|o_i|, GSPO's mean log-ratio, per-sample advantages) need one row per sample. Only
per-token scalars (logprobs, entropy) are moved, so the copy is O(tokens) and cheap; it is an
index gather, so gradients flow back to the packed tensor.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["segments_to_padded"]


def segments_to_padded(
    values: torch.Tensor,
    segments: Sequence[tuple[int, int]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather ``values[begin:end]`` of each segment into the rows of a padded tensor.

    Args:
        values: ``[T]`` or ``[1, T]`` per-position values of one packed micro-batch.
        segments: ``(begin, end)`` position ranges, one per sample, e.g. the scored response
            positions of a packed micro-batch, ``PackedBatch.response_segments()``.

    Returns:
        ``(padded, mask)``: ``[n, max_len]`` values (0 at padding) and the bool mask of real
        positions. With no segments (an empty filler micro-batch) the shapes are ``[0, 0]`` and
        ``padded`` is still connected to ``values`` in the autograd graph.
    """
    if not torch.is_tensor(values) or not (values.dim() == 1 or (values.dim() == 2 and values.shape[0] == 1)):
        raise ValueError(f"values must be [T] or [1, T], got shape {tuple(getattr(values, 'shape', ()))}")
    flat = values.reshape(-1)
    total = flat.shape[0]
    lengths = []
    for i, seg in enumerate(segments):
        if len(seg) != 2:
            raise ValueError(f"segments[{i}] must be (begin, end), got {seg!r}")
        begin, end = int(seg[0]), int(seg[1])
        if not 0 <= begin <= end <= total:
            raise ValueError(f"segments[{i}]=({begin}, {end}) is outside [0, {total}] or reversed")
        lengths.append(end - begin)
    n = len(lengths)
    width = max(lengths, default=0)
    device = flat.device
    begins = torch.tensor([int(s[0]) for s in segments], dtype=torch.long, device=device).reshape(n, 1)
    offsets = torch.arange(width, device=device).reshape(1, width)
    mask = offsets < torch.tensor(lengths, dtype=torch.long, device=device).reshape(n, 1)
    index = torch.where(mask, begins + offsets, torch.zeros((), dtype=torch.long, device=device))
    if total == 0:  # nothing to gather from; keep the graph connection
        return flat.sum() * torch.zeros(n, width, dtype=flat.dtype, device=device), mask
    padded = torch.where(mask, flat[index], torch.zeros((), dtype=flat.dtype, device=device))
    return padded, mask
