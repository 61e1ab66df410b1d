"""Core attention for the local (non-Transformer-Engine) layer spec that understands packed batches.

RL batches are many variable-length samples. We pack them into one row (`thd` format with
`cu_seqlens`) so no token is padding. Megatron-Core already applies RoPE per sample in that format,
but its local `DotProductAttention` refuses packed input. This module runs causal attention on each
sample's own span, so a sample never attends to another and the work is about sum(L_i^2), not
(sum L_i)^2. On GPU the Transformer Engine spec handles `thd` natively and this module is unused.

How: samples are grouped into a few length buckets, each gathered into a right-padded
[samples, heads, L_max, d] batch and run through ONE causal SDPA call, then scattered back. An RL
step has hundreds of short samples, and one SDPA call (plus its backward) per sample made the
per-call overhead, not the arithmetic, the largest cost of a CPU step. Right padding needs no
mask: with causal attention a real position i only sees keys 0..i, which are all real, and the
padded rows' outputs are never read. Buckets keep the padded work within a small factor of the
real work when lengths differ widely (one 4k-token sample among short ones gets its own bucket).

Without packed parameters it behaves like the local attention: causal, or the given mask
(True = masked out) in `sbhd` layout.

Multi-latent attention (DeepSeek-V3) has a value head size (`v_channels`) other than the
query/key head size (`k_channels`, nope + rope dims) and its own softmax scale (YaRN's mscale):
both come from the attention module that builds this one, and the output is heads * v_channels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule


class VarlenDotProductAttention(MegatronModule):
    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise ValueError("context parallelism needs Transformer Engine attention")
        tp_size = (
            pg_collection.tp.size()
            if pg_collection is not None and hasattr(pg_collection, "tp")
            else parallel_state.get_tensor_model_parallel_world_size()
        )
        self.heads = config.num_attention_heads // tp_size
        self.groups = (config.num_query_groups or config.num_attention_heads) // tp_size
        head_dim = k_channels if k_channels is not None else config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by VarlenDotProductAttention")
        dropout = self.dropout if self.training else 0.0
        # Dropout draws from the tensor-parallel RNG stream, as Megatron's local attention does.
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if dropout > 0 else _null()
        with rng:
            if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
                return self._packed(query, key, value, packed_seq_params, dropout)
            return self._padded(query, key, value, attention_mask, dropout)

    def _packed(self, query, key, value, params, dropout):
        return packed_causal_attention(query, key, value, self._plan_for(params.cu_seqlens_q), scale=self.softmax_scale,
                                       dropout=dropout, enable_gqa=self.heads != self.groups)

    def _plan_for(self, cu_seqlens):
        # The plan depends only on cu_seqlens: passes over the same packed batch (the old-logprob
        # forward, then the update) reuse it instead of rebuilding it per pass.
        cached = getattr(self, "_plan_cache", None)
        if cached is None or cached[0] is not cu_seqlens:
            cached = (cu_seqlens, bucket_plan(cu_seqlens))
            self._plan_cache = cached
        return cached[1]

    def _padded(self, query, key, value, attention_mask, dropout):
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        if attention_mask is None:
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=dropout, scale=self.softmax_scale,
                enable_gqa=self.heads != self.groups,
            )
        else:
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=~attention_mask, dropout_p=dropout, scale=self.softmax_scale,
                enable_gqa=self.heads != self.groups,
            )
        s, b = query.shape[0], query.shape[1]
        return o.permute(2, 0, 1, 3).reshape(s, b, -1)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# A bucket's padded size may exceed its real tokens by this factor, or reach this many padded
# tokens regardless (tiny buckets cost nothing, and fewer buckets mean fewer calls).
_BUCKET_SLACK = 1.5
_BUCKET_FREE_TOKENS = 2048


def packed_causal_attention(query, key, value, plan: BucketPlan, *, scale: float, dropout: float = 0.0,
                            enable_gqa: bool = False) -> torch.Tensor:
    """Causal attention within each sample of a packed row.

    query [t, heads, d], key/value [t, groups, d] -> [t, heads * d]."""
    outputs = []
    for gather in plan.gathers:
        n, width = gather.shape
        index = gather.reshape(-1)
        q, k, v = (x.index_select(0, index).view(n, width, *x.shape[1:]).transpose(1, 2) for x in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=scale, enable_gqa=enable_gqa)
        outputs.append(o.transpose(1, 2).reshape(n * width, -1))
    flat = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    return flat.index_select(0, plan.scatter)


@dataclass(frozen=True)
class BucketPlan:
    """How a packed row becomes padded batches and back.

    gathers[b]: [n_b, width_b] token indices into the packed row; a padded slot repeats its
        sample's last token (causality keeps it out of every real position's attention).
    scatter: [t] the row of each packed token in the concatenation of the buckets' outputs.
    """

    gathers: list[torch.Tensor]
    scatter: torch.Tensor


def bucket_plan(cu_seqlens: torch.Tensor) -> BucketPlan:
    bounds = cu_seqlens.to("cpu", torch.long)
    starts, lengths = bounds[:-1], bounds[1:] - bounds[:-1]
    keep = lengths > 0
    starts, lengths = starts[keep], lengths[keep]
    order = torch.argsort(lengths, descending=True, stable=True)
    sorted_lengths = lengths[order].tolist()

    buckets, begin = [], 0
    while begin < len(sorted_lengths):
        width, end, tokens = sorted_lengths[begin], begin + 1, sorted_lengths[begin]
        while end < len(sorted_lengths):
            padded = (end - begin + 1) * width
            if padded > _BUCKET_SLACK * (tokens + sorted_lengths[end]) and padded > _BUCKET_FREE_TOKENS:
                break
            tokens += sorted_lengths[end]
            end += 1
        buckets.append((order[begin:end], width))
        begin = end

    total = int(bounds[-1])
    scatter = torch.empty(total, dtype=torch.long)
    gathers, offset = [], 0
    for members, width in buckets:
        sample_starts, sample_lengths = starts[members], lengths[members]
        column = torch.arange(width)
        within = torch.minimum(column[None, :], sample_lengths[:, None] - 1)
        gather = sample_starts[:, None] + within
        real = column[None, :] < sample_lengths[:, None]
        slots = offset + torch.arange(len(members))[:, None] * width + column[None, :]
        scatter[gather[real]] = slots[real]
        gathers.append(gather.to(cu_seqlens.device))
        offset += len(members) * width
    return BucketPlan(gathers, scatter.to(cu_seqlens.device))
