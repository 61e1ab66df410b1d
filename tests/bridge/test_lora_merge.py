"""The merge of a LoRA adapter into its weight (bridge/lora_merge.py) refuses a result that is not
finite, naming model.lora.alpha: model.lora.alpha=1e308 made the merged weights infinite and the
push's digest check blamed "something else" for them."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.bridge.lora_merge import merged_weight
from megatron_rl.errors import ConfigError


def adapter(scale: float):
    a = torch.full((2, 4), 0.5)  # rank 2, 4 in
    b = torch.full((3, 2), 0.25)  # 3 out
    return a, b, scale


def test_a_merge_is_w_plus_scale_b_a():
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert torch.equal(merged_weight(weight, adapter(2.0)), weight + 2.0 * torch.full((3, 4), 0.25))
    assert merged_weight(weight, None) is weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_merge_that_overflows_is_refused_naming_alpha(dtype):
    weight = torch.ones(3, 4, dtype=dtype)
    with pytest.raises(ConfigError) as info:
        merged_weight(weight, adapter(1e308 / 8), "decoder.layers.0.self_attention.linear_qkv.weight")
    message = str(info.value)
    assert message.startswith(f"merging the LoRA adapter into decoder.layers.0.self_attention.linear_qkv.weight "
                              f"((3, 4), {dtype}) gives non-finite values: the merged weight is W + (alpha / rank = "
                              f"1.25e+307) x B A, with |B A| up to 0.25. model.lora.alpha is too large"), message


def test_a_weight_that_was_not_finite_already_is_not_blamed_on_the_adapter():
    weight = torch.ones(3, 4)
    weight[0, 0] = float("nan")
    assert torch.isnan(merged_weight(weight, adapter(1.0))[0, 0])
