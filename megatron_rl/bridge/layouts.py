"""Fused-layout transforms between one Megatron tensor and its HF pieces.

Every transform works on a whole tensor or on one tensor-parallel shard of it, because Megatron
shards fused tensors by whole groups: a TP shard of linear_qkv holds complete KV groups, and a
TP shard of linear_fc1 holds [gate_r; up_r]. So export splits each gathered shard and
concatenates the pieces across shards; import slices each piece and merges per shard.
"""

from __future__ import annotations

import torch

from megatron_rl.model.hf_config import ArchitectureSpec


def split(layout: str, tensor: torch.Tensor, arch: ArchitectureSpec) -> list[torch.Tensor]:
    """Megatron tensor (or TP shard) -> HF pieces (or their TP shards)."""
    if layout in ("plain", "vocab"):
        return [tensor]
    if layout == "gate_up":
        gate, up = tensor.chunk(2, dim=0)
        return [gate, up]
    if layout == "qkv":
        q_per_group, head_dim = _qkv_geometry(arch)
        rows = (q_per_group + 2) * head_dim
        grouped = tensor.reshape(tensor.shape[0] // rows, rows, *tensor.shape[1:])
        q = grouped[:, : q_per_group * head_dim]
        k = grouped[:, q_per_group * head_dim : (q_per_group + 1) * head_dim]
        v = grouped[:, (q_per_group + 1) * head_dim :]
        return [x.reshape(-1, *tensor.shape[1:]) for x in (q, k, v)]
    raise ValueError(f"unknown layout {layout!r}")


def merge(layout: str, pieces: list[torch.Tensor], arch: ArchitectureSpec) -> torch.Tensor:
    """HF pieces (or their TP shards) -> Megatron tensor (or TP shard). Inverse of split."""
    if layout in ("plain", "vocab"):
        return pieces[0]
    if layout == "gate_up":
        return torch.cat(pieces, dim=0)
    if layout == "qkv":
        q_per_group, head_dim = _qkv_geometry(arch)
        q, k, v = pieces
        groups = k.shape[0] // head_dim
        trailing = q.shape[1:]
        return torch.cat(
            [
                q.reshape(groups, q_per_group * head_dim, *trailing),
                k.reshape(groups, head_dim, *trailing),
                v.reshape(groups, head_dim, *trailing),
            ],
            dim=1,
        ).reshape(-1, *trailing)
    raise ValueError(f"unknown layout {layout!r}")


def piece_rows(layout: str, local_rows: int, arch: ArchitectureSpec) -> list[int]:
    """Rows of each HF piece inside a Megatron tensor (or shard) with `local_rows` rows."""
    if layout in ("plain", "vocab"):
        return [local_rows]
    if layout == "gate_up":
        return [local_rows // 2, local_rows // 2]
    q_per_group, head_dim = _qkv_geometry(arch)
    groups = local_rows // ((q_per_group + 2) * head_dim)
    return [groups * q_per_group * head_dim, groups * head_dim, groups * head_dim]


def _qkv_geometry(arch: ArchitectureSpec) -> tuple[int, int]:
    return arch.num_attention_heads // arch.num_key_value_heads, arch.head_dim
