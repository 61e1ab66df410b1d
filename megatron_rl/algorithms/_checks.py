"""Input checks shared by the algorithm modules (private).

Every public function validates its inputs and raises ``ValueError`` naming the offending
argument and value: a wrong shape or a stray NaN in a loss silently corrupts a run that costs
GPU-days, so failing loudly at the boundary is worth the few cheap checks.
"""

from __future__ import annotations

import math

import torch

__all__ = ["compute_dtype", "check_mask", "check_same_shape", "check_float", "finite_number"]


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 when any input is float64 (oracle tests), else float32 (never bf16/fp16 math)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def check_float(x, name: str, dim: int | tuple[int, ...] | None = None) -> None:
    if not torch.is_tensor(x) or not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    dims = (dim,) if isinstance(dim, int) else dim
    if dims is not None and x.dim() not in dims:
        raise ValueError(f"{name} must have {' or '.join(map(str, dims))} dimension(s), got shape {tuple(x.shape)}")


def check_same_shape(x: torch.Tensor, ref: torch.Tensor, name: str, ref_name: str) -> None:
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"{name} shape {tuple(x.shape)} must equal {ref_name} shape {tuple(ref.shape)}")


def check_mask(mask, name: str = "mask", dim: int | None = 2) -> torch.Tensor:
    """Return ``mask`` as a bool tensor; accepts bool or 0/1 numeric masks, rejects anything else.

    A float mask with a 0.5 in it is a bug upstream (e.g. an averaged mask), not a weight: the
    loss would silently down-weight tokens, so it is rejected.
    """
    if not torch.is_tensor(mask):
        raise ValueError(f"{name} must be a tensor, got {type(mask).__name__}")
    if dim is not None and mask.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimension(s) [batch, seq], got shape {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise ValueError(f"{name} must be bool or 0/1, got dtype {mask.dtype}")
    if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        bad = mask[(mask != 0) & (mask != 1)].reshape(-1)[0].item()
        raise ValueError(f"{name} must contain only 0 and 1, found {bad}")
    return mask != 0


def finite_number(value, name: str, *, low: float | None = None, high: float | None = None,
                  low_open: bool = False, allow_none: bool = False) -> None:
    """Validate a scalar config value (finite, optionally bounded); the message names ``name``."""
    if value is None:
        if allow_none:
            return
        raise ValueError(f"{name} must be a number, got None")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value!r}")
