"""Step normalizer counts, metric combination, the length-bias diagnostic, packed -> padded."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms import (StepNormalizer, agg_loss, compute_step_normalizer, length_bias_metrics,
                                    reduce_metrics, segments_to_padded)


def mask_of(lengths, width):
    m = torch.zeros(len(lengths), width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        m[i, :n] = True
    return m


def test_step_normalizer_counts_over_micro_batches():
    masks = [mask_of([3, 0, 5], 6), mask_of([1], 2), mask_of([], 4), mask_of([7, 2], 7).float()]
    n = compute_step_normalizer(masks, "seq-mean-token-sum-norm")
    assert (n.num_tokens, n.num_sequences, n.max_length, n.l_norm) == (18, 5, 7, 7)  # empty rows do not count
    assert compute_step_normalizer(masks, "seq-mean-token-sum-norm", l_norm=4096).l_norm == 4096
    assert compute_step_normalizer(mask_of([2, 2], 3)).num_tokens == 4  # one tensor = one micro-batch
    empty = compute_step_normalizer([], "token-mean")
    assert (empty.num_tokens, empty.num_sequences, empty.l_norm) == (0, 0, 1.0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        compute_step_normalizer(masks, "sum")
    with pytest.raises(ValueError, match="masks\\[1\\]"):
        compute_step_normalizer([mask_of([1], 2), torch.full((1, 2), 2.0)])
    with pytest.raises(ValueError, match="l_norm"):
        compute_step_normalizer(masks, l_norm=0)
    with pytest.raises(ValueError, match="num_sequences"):
        StepNormalizer("token-mean", num_tokens=1, num_sequences=2, max_length=1, l_norm=1)


def test_agg_loss_modes_closed_forms():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, float("nan")]], dtype=torch.float64)  # NaN in padding
    m = mask_of([3, 1], 3)
    assert agg_loss(v, m, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(v, m, "seq-mean-token-mean").item() == pytest.approx((6 / 3 + 4 / 1) / 2)
    assert agg_loss(v, m, "seq-mean-token-sum").item() == pytest.approx(10 / 2)
    assert agg_loss(v, m, "seq-mean-token-sum-norm").item() == pytest.approx(10 / (2 * 3))
    assert agg_loss(v, m, "seq-mean-token-sum-norm", l_norm=10).item() == pytest.approx(10 / 20)
    assert agg_loss(v, m, "token-sum").item() == pytest.approx(10)
    step = compute_step_normalizer([m, mask_of([4], 4)], "token-mean")
    assert agg_loss(v, m, "token-mean", step).item() == pytest.approx(10 / 8)  # divided by the STEP's tokens


def test_reduce_metrics_combines_exactly():
    a = {"count/tokens/sum": torch.tensor(3.0), "count/sequences/sum": 1.0, "x/tok_sum": torch.tensor(6.0),
         "y/seq_sum": 2.0, "l/sum": torch.tensor(0.5), "hi/max": torch.tensor(2.0), "lo/min": torch.tensor(0.5)}
    b = {"count/tokens/sum": 1.0, "count/sequences/sum": 1.0, "x/tok_sum": 2.0, "y/seq_sum": 4.0, "l/sum": 0.25,
         "hi/max": torch.tensor(float("-inf")), "lo/min": torch.tensor(0.25)}
    out = reduce_metrics([a, b])
    assert out == {"count/tokens": 4.0, "count/sequences": 2.0, "x": 2.0, "y": 3.0, "l": 0.75, "hi": 2.0, "lo": 0.25}
    assert reduce_metrics(a) == reduce_metrics([a])  # a single dict is one micro-batch
    with pytest.raises(ValueError, match="both map to 'r'"):
        reduce_metrics([{"r/max": 1.0, "r/min": 0.0}])
    out = reduce_metrics([{"count/tokens/sum": 0.0, "m/tok_sum": 0.0, "hi/max": float("-inf"), "lo/min": float("inf")}])
    assert out == {"count/tokens": 0.0}  # no data -> left out, never NaN
    with pytest.raises(ValueError, match="combine suffix"):
        reduce_metrics([{"loss": 1.0}])
    with pytest.raises(ValueError, match="count/tokens/sum"):
        reduce_metrics([{"m/tok_sum": 1.0}])


def test_length_bias_metrics_seed():
    rewards = torch.tensor([[1.1, 0.1, 0.0, 1.1]])
    lengths = torch.tensor([[220, 950, 1100, 180]])
    out = length_bias_metrics(rewards, lengths)
    assert out["length/correct_mean"] == 200 and out["length/wrong_mean"] == 1025
    assert out["length/wrong_minus_correct"] == 825 and out["length/wrong_minus_correct_in_group"] == 825
    assert (out["count/correct"], out["count/wrong"], out["count/mixed_groups"]) == (2, 2, 1)
    assert out["length/mean"] == 612.5
    # within-group differences control for prompt difficulty: a batch-level gap can vanish in-group
    r = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
    n = torch.tensor([[100, 100], [1000, 1000], [5000, 5000]])
    out = length_bias_metrics(r, n)
    assert out["length/wrong_minus_correct"] > 0 and out["length/wrong_minus_correct_in_group"] == 0
    assert "length/correct_mean" not in length_bias_metrics(torch.zeros(4), torch.ones(4))  # no correct sample
    with pytest.raises(ValueError, match="lengths shape"):
        length_bias_metrics(rewards, lengths[0])


def test_segments_to_padded_gathers_with_gradient():
    values = torch.arange(10, dtype=torch.float64).requires_grad_(True)
    padded, mask = segments_to_padded(values, [(1, 4), (6, 7), (8, 8)])
    assert padded.tolist() == [[1, 2, 3], [6, 0, 0], [0, 0, 0]]
    assert mask.tolist() == [[True, True, True], [True, False, False], [False, False, False]]
    (padded * torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=torch.float64)).sum().backward()
    assert values.grad.tolist() == [0, 1, 2, 3, 0, 0, 4, 0, 0, 0]
    empty, m = segments_to_padded(values.detach().reshape(1, 10).requires_grad_(True), [])
    assert empty.shape == (0, 0) and m.shape == (0, 0) and empty.grad_fn is not None
    with pytest.raises(ValueError, match="segments\\[0\\]"):
        segments_to_padded(values, [(5, 11)])
