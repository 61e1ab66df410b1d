"""Pack variable-length samples into padding-free micro-batches.

A micro-batch is one row of concatenated samples plus `cu_seqlens` marking where each begins
(Megatron's `thd` format). Attention stays inside each sample (see varlen_attention.py and TE's
fused attention) and RoPE positions restart at 0 for every sample, so a packed sample computes
exactly what it would alone. The only padding is at most `pad_to_multiple - 1` tokens at the end,
as a separate dummy sample, because sequence parallelism splits the row evenly across TP ranks.

Position i predicts token i+1. For a sample with prompt length P and total length L, the scored
(response) tokens are P..L-1 and their logprobs come from positions P-1..L-2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64, restarting at 0 per sample
    labels: torch.Tensor  # [1, T] int64: the next token of the same sample (0 where none)
    loss_mask: torch.Tensor  # [1, T] float32: 1 where labels[i] is a response token
    cu_seqlens: torch.Tensor  # [n + 1] int32, including the trailing padding segment if any
    max_seqlen: int
    spans: list[tuple[int, int, int]]  # (start, prompt_length, length) per real sample
    sample_ids: list[int]  # index of each sample in the caller's list

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def to(self, device: torch.device) -> PackedBatch:
        moved = {k: getattr(self, k).to(device) for k in ("input_ids", "position_ids", "labels", "loss_mask")}
        return PackedBatch(**moved, cu_seqlens=self.cu_seqlens.to(device), max_seqlen=self.max_seqlen,
                           spans=self.spans, sample_ids=self.sample_ids)

    def packed_seq_params(self):
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )

    def response_segments(self) -> list[tuple[int, int]]:
        """(begin, end) positions whose next-token logprobs score each sample's response."""
        return [(start + prompt - 1, start + length - 1) for start, prompt, length in self.spans]

    def response_values(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Split a per-position tensor [T] (or [1, T]) into one tensor per sample, response tokens only."""
        flat = values.reshape(-1)
        return [flat[begin:end] for begin, end in self.response_segments()]


def pack(
    samples: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    pad_to_multiple: int = 1,
    sample_ids: Sequence[int] | None = None,
) -> PackedBatch:
    if len(samples) != len(prompt_lengths):
        raise ValueError(f"{len(samples)} samples but {len(prompt_lengths)} prompt lengths")
    ids, positions, labels, mask, bounds, spans = [], [], [], [], [0], []
    for index, (tokens, prompt) in enumerate(zip(samples, prompt_lengths)):
        length = len(tokens)
        if not 1 <= prompt <= length:
            raise ValueError(f"sample {index}: prompt length {prompt} must be in [1, {length}]")
        start = bounds[-1]
        ids.extend(tokens)
        positions.extend(range(length))
        labels.extend(list(tokens[1:]) + [0])
        mask.extend([0.0] * (prompt - 1) + [1.0] * (length - prompt) + [0.0])
        spans.append((start, prompt, length))
        bounds.append(start + length)
    padding = (-bounds[-1]) % pad_to_multiple
    if padding:
        ids.extend([0] * padding)
        positions.extend(range(padding))
        labels.extend([0] * padding)
        mask.extend([0.0] * padding)
        bounds.append(bounds[-1] + padding)
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([positions], dtype=torch.long),
        labels=torch.tensor([labels], dtype=torch.long),
        loss_mask=torch.tensor([mask], dtype=torch.float32),
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
        max_seqlen=max(lengths) if lengths else 0,
        spans=spans,
        sample_ids=list(sample_ids) if sample_ids is not None else list(range(len(samples))),
    )


def pack_by_token_budget(
    samples: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    token_budget: int,
    pad_to_multiple: int = 1,
) -> list[PackedBatch]:
    """Greedy, order-preserving packing into micro-batches of at most `token_budget` tokens.

    A sample longer than the budget gets a micro-batch of its own (it cannot be split).
    """
    batches, current = [], []
    used = 0
    for index, tokens in enumerate(samples):
        if current and used + len(tokens) > token_budget:
            batches.append(current)
            current, used = [], 0
        current.append(index)
        used += len(tokens)
    if current:
        batches.append(current)
    return [
        pack([samples[i] for i in group], [prompt_lengths[i] for i in group], pad_to_multiple, sample_ids=group)
        for group in batches
    ]
