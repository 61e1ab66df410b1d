"""Packed attention (model/varlen_attention.py) against scaled_dot_product_attention run on each
sample alone: values and gradients, on lengths that force several padding buckets."""

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.model.varlen_attention import bucket_plan, packed_causal_attention


def _each_alone(query, key, value, bounds, scale, enable_gqa):
    out = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
        out.append(o.transpose(0, 1).reshape(end - start, -1))
    return torch.cat(out)


@pytest.mark.parametrize("lengths", [
    [5, 17, 1, 9, 3],  # one bucket
    [2600, 1, 7, 2100, 5, 40, 40, 3, 900],  # long and short samples: several buckets
])
def test_packed_attention_equals_each_sample_alone(lengths):
    torch.manual_seed(0)
    heads, groups, dim = 4, 2, 8
    total = sum(lengths)
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    query = torch.randn(total, heads, dim, dtype=torch.float64, requires_grad=True)
    key = torch.randn(total, groups, dim, dtype=torch.float64, requires_grad=True)
    value = torch.randn(total, groups, dim, dtype=torch.float64, requires_grad=True)
    plan = bucket_plan(torch.tensor(bounds, dtype=torch.int32))
    if len(lengths) > 5:
        assert len(plan.gathers) > 1, "these lengths must be split into several buckets"
    # Padded work stays within the bucket rule's bound of the real work.
    padded = sum(g.numel() for g in plan.gathers)
    assert padded <= max(1.5 * total, total + 2048 * len(plan.gathers))

    packed = packed_causal_attention(query, key, value, plan, scale=0.3, enable_gqa=True)
    reference = _each_alone(query, key, value, bounds, 0.3, True)
    assert packed.shape == (total, heads * dim)
    assert (packed - reference).abs().max().item() < 1e-12

    weights = torch.randn_like(reference)
    grads = torch.autograd.grad((packed * weights).sum(), (query, key, value))
    expected = torch.autograd.grad((reference * weights).sum(), (query, key, value))
    for got, want in zip(grads, expected):
        assert (got - want).abs().max().item() < 1e-12


def test_empty_segments_are_skipped():
    plan = bucket_plan(torch.tensor([0, 3, 3, 5], dtype=torch.int32))
    assert sorted(plan.scatter.tolist()) == sorted(set(plan.scatter.tolist()))
    assert plan.scatter.numel() == 5
