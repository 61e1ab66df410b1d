"""Block-wise FP8 export for the rollout engine: values, scale shapes, names, exclusions.

Oracles: a per-block loop written here (scales), transformers' own FP8 dequantization (values,
on 128-multiple shapes, which is all it accepts), and e4m3's rounding bound (3 mantissa bits).
The end-to-end path from a sharded Megatron model is in tests/bridge/test_grouped_experts.py.
"""

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.bridge.fp8_export import (
    FP8_MAX,
    dequantize_blockwise,
    fp8_quantization_config,
    modules_to_not_convert,
    quantize_blockwise,
    quantize_fp8_blockwise,
    quantized_names,
)
from megatron_rl.model.hf_config import load_hf_config, parse_hf_config


def within_e4m3(weight: torch.Tensor, quantized: torch.Tensor, scale_inv: torch.Tensor) -> None:
    """|dequantized - w| <= |w| * 2^-4 (normal e4m3) + half a subnormal step of the block's scale."""
    restored = dequantize_blockwise(quantized, scale_inv)
    rows, cols = weight.shape
    scale = scale_inv.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    bound = weight.float().abs() * 2**-4 + scale * 2**-10
    assert ((restored - weight.float()).abs() <= bound * (1 + 1e-6)).all()


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (128, 129), (1, 1), (64, 2048)])
def test_round_trip_within_e4m3_and_scale_grid(shape):
    torch.manual_seed(0)
    weight = torch.randn(shape) * 0.02
    quantized, scale_inv = quantize_blockwise(weight)
    assert quantized.dtype == torch.float8_e4m3fn and quantized.shape == weight.shape
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    within_e4m3(weight, quantized, scale_inv)
    for i in range(scale_inv.shape[0]):  # each block's largest magnitude maps to e4m3's largest value
        for j in range(scale_inv.shape[1]):
            block = weight[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            assert scale_inv[i, j] == pytest.approx(block.abs().max().item() / 448, rel=1e-6)
            assert quantized[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float().abs().max() == FP8_MAX


def test_each_scale_is_amax_over_448_correctly_rounded():
    """The export must be the same bits on every device. Division by a Python float runs on CUDA as
    a multiply by its rounded reciprocal; the scale is defined as true division, which float64
    rounded once to float32 reproduces exactly (a multiply by float32(1/448) differs on more than
    half of these blocks, and so do the values quantized with them)."""
    torch.manual_seed(3)
    weight = torch.randn(128 * 16, 128 * 16) * torch.logspace(-4, 1, 128 * 16)[:, None]
    quantized, scale_inv = quantize_blockwise(weight)
    amax = weight.view(16, 128, 16, 128).abs().amax(dim=(1, 3))
    assert torch.equal(scale_inv, (amax.double() / 448).float())


def test_blocks_are_scaled_independently():
    weight = torch.randn(256, 256) * 1e-3
    weight[:128, 128:] *= 1e4  # one loud block must not flush the quiet ones to zero
    weight[128:, :128] = 0  # an all-zero block stays exactly zero
    quantized, scale_inv = quantize_blockwise(weight.bfloat16())
    within_e4m3(weight.bfloat16(), quantized, scale_inv)
    assert torch.isfinite(scale_inv).all() and (scale_inv > 0).all()
    assert dequantize_blockwise(quantized, scale_inv)[128:, :128].eq(0).all()
    relative = (dequantize_blockwise(quantized, scale_inv)[:128, :128] - weight[:128, :128].bfloat16().float()).abs()
    assert relative.max() <= weight[:128, :128].abs().max() * 2**-4


def test_matches_transformers_dequantization():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    weight = torch.randn(384, 256)
    quantized, scale_inv = quantize_blockwise(weight)
    theirs = Fp8Dequantize(None).convert({"weight": quantized, "weight_scale_inv": scale_inv})["weight"]
    theirs = theirs[0] if isinstance(theirs, list) else theirs  # transformers < 5.23 returns a one-item list
    assert torch.equal(theirs, dequantize_blockwise(quantized, scale_inv))


def test_only_2d_weights():
    with pytest.raises(ValueError, match="2-D weights"):
        quantize_blockwise(torch.ones(4))


def arch_of(preset: str, **changes):
    raw, where = load_hf_config(preset)
    return parse_hf_config(dict(raw, **changes), where)


def test_linear_weights_are_quantized_and_the_rest_is_kept():
    names = quantized_names(arch_of("tiny-qwen3-moe"))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight",
                 "model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.experts.0.down_proj.weight"):
        assert name in names
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.mlp.gate.weight",
                 "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_norm.weight"):
        assert name not in names
    skipped = modules_to_not_convert(arch_of("tiny-qwen3-moe"))
    assert {"lm_head", "model.embed_tokens", "model.norm", "model.layers.0.mlp.gate",
            "model.layers.1.post_attention_layernorm", "model.layers.0.self_attn.k_norm"} <= set(skipped)
    assert not any("proj" in module for module in skipped)


def test_other_families():
    mixtral = arch_of("tiny-llama", architectures=["MixtralForCausalLM"], model_type="mixtral",
                      num_local_experts=4, num_experts_per_tok=2)
    names = quantized_names(mixtral)
    assert "model.layers.0.block_sparse_moe.experts.2.w3.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" not in names
    assert "model.layers.0.block_sparse_moe.gate" in modules_to_not_convert(mixtral)
    qwen2 = arch_of("tiny-llama", architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    assert "model.layers.0.self_attn.q_proj.weight" in quantized_names(qwen2)
    assert "model.layers.0.self_attn.q_proj.bias" not in quantized_names(qwen2)  # biases stay as exported
    tied = arch_of("tiny-qwen3")
    assert tied.tie_word_embeddings and "lm_head" in modules_to_not_convert(tied)


def test_quantization_config_is_the_hf_fp8_format():
    from transformers.utils.quantization_config import FineGrainedFP8Config

    arch = arch_of("tiny-qwen3-moe")
    entry = fp8_quantization_config(arch)
    assert {k: entry[k] for k in ("quant_method", "fmt", "activation_scheme", "weight_block_size")} == \
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    parsed = FineGrainedFP8Config.from_dict(entry)
    assert list(parsed.weight_block_size) == [128, 128] and parsed.modules_to_not_convert == entry["modules_to_not_convert"]


def test_stream_wrapper_on_a_checkpoint(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    raw, _ = load_hf_config("tiny-qwen3-moe")
    torch.manual_seed(0)
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **fields))
    model.save_pretrained(tmp_path)  # the on-disk (per-expert) names, which the bridge exports
    tensors = {k: v for file in tmp_path.glob("*.safetensors") for k, v in load_file(file).items()}
    names = sorted(tensors)
    buckets = [[(n, tensors[n]) for n in names[i:i + 7]] for i in range(0, len(names), 7)]
    arch = arch_of("tiny-qwen3-moe")
    quantized = quantized_names(arch)
    assert quantized <= set(names)

    out = list(quantize_fp8_blockwise(iter(buckets), arch))
    assert len(out) == len(buckets)
    flat = dict(pair for bucket in out for pair in bucket)
    assert sorted(flat) == sorted(names + [n + "_scale_inv" for n in quantized])
    for name, tensor in tensors.items():
        if name in quantized:
            assert flat[name].dtype == torch.float8_e4m3fn
            within_e4m3(tensor, flat[name], flat[name + "_scale_inv"])
        else:
            assert flat[name] is tensor
