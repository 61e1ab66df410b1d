"""DAPO overlong shaping, truncated-completion masking, dynamic-sampling filter."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms import (apply_overlong_penalty, dynamic_sampling_keep, is_truncated, mask_truncated,
                                    overlong_penalty, zero_spread_groups)


def test_overlong_penalty_follows_dapo_eq13():
    # L_max = 20, L_cache = 8: free up to 12, linear to -1 at 20, -1 beyond.
    lengths = torch.tensor([0, 12, 13, 16, 20, 21, 100])
    pen = overlong_penalty(lengths, max_length=20, buffer_length=8)
    want = torch.tensor([0.0, 0.0, -1 / 8, -4 / 8, -1.0, -1.0, -1.0])
    torch.testing.assert_close(pen, want)
    assert pen.dtype == torch.float32
    torch.testing.assert_close(overlong_penalty(lengths, max_length=20, buffer_length=8, penalty_factor=0.5), want / 2)
    shaped = apply_overlong_penalty(torch.tensor([[1.1, 0.1]]), torch.tensor([[16, 5]]), max_length=20, buffer_length=8)
    torch.testing.assert_close(shaped, torch.tensor([[0.6, 0.1]]))


def test_overlong_errors():
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(torch.tensor([1]), max_length=10, buffer_length=11)
    with pytest.raises(ValueError, match="max_length"):
        overlong_penalty(torch.tensor([1]), max_length=0, buffer_length=1)
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        overlong_penalty(torch.tensor([-1]), max_length=10, buffer_length=2)
    with pytest.raises(ValueError, match="shape"):
        apply_overlong_penalty(torch.ones(2), torch.ones(3), max_length=10, buffer_length=2)


def test_truncation_masking():
    lengths = torch.tensor([3, 5, 5])
    trunc = is_truncated(lengths, max_length=5)
    assert trunc.tolist() == [False, True, True]
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.float32)
    out = mask_truncated(mask, trunc)
    assert out.dtype == torch.float32
    assert out.tolist() == [[1, 1, 1, 0, 0], [0] * 5, [0] * 5]
    assert mask_truncated(mask.bool(), trunc).dtype == torch.bool
    with pytest.raises(ValueError, match="rows"):
        mask_truncated(mask, trunc[:2])


def test_dynamic_sampling_filter():
    r = torch.tensor([[1.1, 0.1, 0.0, 1.1], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.5, 0.5 + 1e-4, 0.5, 0.5]])
    assert zero_spread_groups(r).tolist() == [False, True, True, False]
    assert zero_spread_groups(r, atol=1e-3).tolist() == [False, True, True, True]
    assert dynamic_sampling_keep(r).tolist() == [True, False, False, True]  # the seed group is kept
    with pytest.raises(ValueError, match=r"\[groups, G\]"):
        zero_spread_groups(torch.ones(4))
