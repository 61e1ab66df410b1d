"""Core attention for the local (non-Transformer-Engine) layer spec that understands packed batches.

RL batches are many variable-length samples. We pack them into one row (`thd` format with
`cu_seqlens`) so no token is padding. Megatron-Core already applies RoPE per sample in that format,
but its local `DotProductAttention` refuses packed input. This module runs causal attention on each
sample's own span, so a sample never attends to another and the work is sum(L_i^2), not
(sum L_i)^2. On GPU the Transformer Engine spec handles `thd` natively and this module is unused.

Without packed parameters it behaves like the local attention: causal, or the given mask
(True = masked out) in `sbhd` layout.
"""

from __future__ import annotations

import math

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
        head_dim = config.kv_channels
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
        # query [t, heads, d], key/value [t, groups, d]; one causal block per sample.
        bounds = params.cu_seqlens_q.tolist()
        out = query.new_empty(query.shape)
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end == start:
                continue
            q = query[start:end].transpose(0, 1)  # [heads, L, d]
            k = key[start:end].transpose(0, 1)
            v = value[start:end].transpose(0, 1)
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=dropout, scale=self.softmax_scale,
                enable_gqa=self.heads != self.groups,
            )
            out[start:end] = o.transpose(0, 1)
        return out.reshape(out.shape[0], -1)

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
