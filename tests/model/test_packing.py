"""Packing variable-length samples into padding-free micro-batches."""

import pytest
import torch

from megatron_rl.model.packing import pack, pack_by_token_budget


def test_pack_layout():
    batch = pack([[5, 6, 7, 8], [9, 10, 11]], [2, 1], pad_to_multiple=4)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    assert batch.cu_seqlens.tolist() == [0, 4, 7, 8]  # the padding is a sample of its own
    assert batch.labels.tolist() == [[6, 7, 8, 0, 10, 11, 0, 0]]
    # sample 0 scores tokens 7, 8 (positions 1, 2); sample 1 scores 10, 11 (positions 4, 5)
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0, 1, 1, 0, 0]]
    values = torch.arange(8.0)
    assert [v.tolist() for v in batch.response_values(values)] == [[1.0, 2.0], [4.0, 5.0]]
    assert batch.max_seqlen == 4


def test_response_values_match_labels():
    samples = [[1, 2, 3, 4, 5], [6, 7, 8]]
    batch = pack(samples, [3, 1])
    got = [v.tolist() for v in batch.response_values(batch.labels[0].float())]
    assert got == [[4.0, 5.0], [7.0, 8.0]]


def test_token_budget_keeps_order_and_fits():
    samples = [[1] * n for n in (5, 5, 3, 9, 20, 2)]
    batches = pack_by_token_budget(samples, [1] * 6, token_budget=10, pad_to_multiple=2)
    assert [b.sample_ids for b in batches] == [[0, 1], [2], [3], [4], [5]]
    assert all(b.num_tokens % 2 == 0 for b in batches)
    assert all(b.num_tokens <= 10 for b in batches if len(b.sample_ids) > 1)


def test_bad_prompt_length():
    with pytest.raises(ValueError, match="sample 0: prompt length 0"):
        pack([[1, 2]], [0])
    with pytest.raises(ValueError, match="2 samples but 1 prompt lengths"):
        pack([[1, 2], [3]], [1])
