"""FP8 weights for the rollout engine: 128x128 block-wise e4m3 quantization of the export stream.

    buckets = export_hf_weights(module, arch)                    # (hf_name, tensor) buckets
    for bucket in quantize_fp8_blockwise(buckets, arch): ...     # bucketed, or
    stream = fp8_rollout_stream(hf_weight_stream(...), arch)     # weight sync's flat stream, or
    write_hf_checkpoint(..., fp8=True)                           # an HF FP8 checkpoint
    with_quantization_config(raw_config, arch, fp8=True)         # the matching config.json

All of them quantize through one function (`_quantized_pairs`), so an engine fed by weight sync
holds exactly the bytes an FP8 HF checkpoint of the same weights holds.

The format is the one DeepSeek-V3 and the Qwen3 "-FP8" checkpoints use, which vLLM, SGLang and
transformers load as "fp8" with block-wise weight scales:

    <module>.weight            float8_e4m3fn, the weight's own shape
    <module>.weight_scale_inv  float32, [ceil(rows / 128), ceil(cols / 128)]; the weight is
                               fp8 * weight_scale_inv, block by block (the last block of a
                               dimension that is not a multiple of 128 is partial)
    config.json                "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                               "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                               "modules_to_not_convert": [...]}

Quantized: the linear layers' weights (attention q/k/v/o, the multi-latent attention
projections, dense MLPs, shared experts, every expert). Kept as
exported: embeddings, lm_head, norms and router gates, as in those checkpoints, and biases.
Which HF tensors are linear weights is read from the mapping table's Megatron side (the
linear_qkv / linear_proj / linear_fc1 / linear_fc2 / MLA linear_q*_proj and linear_kv*_proj
modules), so no HF name is pattern-matched.

Engines load block-wise FP8 per tensor-parallel shard: vLLM requires every fused piece
(q/k/v, gate/up) and every TP shard of a linear to be a whole number of 128-row blocks, and
transformers' dequantize-on-load assumes dimensions that are multiples of 128. Production models
(hidden 2048+, head_dim 128, expert widths 768+) satisfy this; the tiny test presets do not, so
their FP8 exports are checked here by dequantizing, not by loading them into an engine.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F

from megatron_rl.bridge.mappings import expand
from megatron_rl.model.hf_config import ArchitectureSpec

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
SCALE_SUFFIX = "_scale_inv"  # "q_proj.weight" -> "q_proj.weight_scale_inv"
# The Megatron modules whose weights are GEMM weights (fused or per expert).
_LINEAR = re.compile(r"\.(linear_qkv|linear_proj|linear_fc1|linear_fc2|linear_q_proj|linear_q_down_proj|"
                     r"linear_q_up_proj|linear_kv_down_proj|linear_kv_up_proj)\.weight$")

Bucket = list[tuple[str, torch.Tensor]]


def quantized_in_export(megatron_name: str) -> bool:
    """Whether an FP8 export serves this Megatron parameter in block FP8 (a GEMM weight)."""
    return _LINEAR.search(megatron_name) is not None


def quantized_names(arch: ArchitectureSpec) -> frozenset[str]:
    """HF tensor names that an FP8 export quantizes (each gets a `<name>_scale_inv` beside it)."""
    return frozenset(hf for megatron, hf_names, _ in expand(arch) if quantized_in_export(megatron) for hf in hf_names)


def modules_to_not_convert(arch: ArchitectureSpec) -> list[str]:
    """HF modules whose weights stay unquantized, for the checkpoint's quantization_config."""
    quantized = quantized_names(arch)
    kept = {hf.removesuffix(".weight") for _, hf_names, _ in expand(arch) for hf in hf_names
            if hf.endswith(".weight") and hf not in quantized}
    # The output head stays high-precision even when it shares the embedding (no lm_head tensor).
    return sorted(kept | {"lm_head"})


def fp8_quantization_config(arch: ArchitectureSpec, block: int = BLOCK) -> dict:
    """The `quantization_config` entry of config.json for an FP8 export."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
        "modules_to_not_convert": modules_to_not_convert(arch),
    }


def quantize_blockwise(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 weight_scale_inv) for a 2-D weight, one scale per block.

    Each block's scale maps its largest magnitude to e4m3's largest finite value (448), so no
    value saturates and the relative rounding error is at most 2^-4 (3 mantissa bits).
    """
    if weight.dim() != 2:
        raise ValueError(f"block-wise FP8 quantizes 2-D weights, got shape {list(weight.shape)}")
    rows, cols = weight.shape
    grid = (-(-rows // block), -(-cols // block))
    padded = F.pad(weight.float(), (0, grid[1] * block - cols, 0, grid[0] * block - rows))
    blocks = padded.view(grid[0], block, grid[1], block)
    amax = blocks.abs().amax(dim=(1, 3))
    # An all-zero block gets the smallest positive scale: its values quantize to exact zeros.
    # A tensor divisor, not the Python float: CUDA divides by a CPU scalar as a multiply by its
    # rounded reciprocal, one ulp off true division for some blocks, and the export must be the
    # same bits on every device (the GPU kit's stage c found 8 of 8 tensors differing).
    scale_inv = (amax / amax.new_tensor(FP8_MAX)).clamp(min=torch.finfo(torch.float32).tiny)
    scaled = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    quantized = scaled.to(FP8_DTYPE).view(padded.shape)[:rows, :cols].contiguous()
    return quantized, scale_inv.contiguous()


def dequantize_blockwise(
    quantized: torch.Tensor, scale_inv: torch.Tensor, block: int | tuple[int, int] = BLOCK,
    dtype: torch.dtype = torch.float32, *, origin: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """The weight an engine computes with: fp8 values times their block's scale.

    `block`: one size for square blocks, or (rows, cols) as a checkpoint's `weight_block_size`.
    `origin`: where `quantized` starts in the full weight when it is only a window of it (the
    importer reads each rank's own rows and columns); `scale_inv` then holds the scales of the
    blocks the window touches, starting with block (origin[0] // rows, origin[1] // cols).
    """
    block_rows, block_cols = (block, block) if isinstance(block, int) else block
    rows, cols = quantized.shape
    first_row, first_col = origin[0] % block_rows, origin[1] % block_cols
    scales = scale_inv.float().repeat_interleave(block_rows, dim=0)[first_row:first_row + rows]
    scales = scales.repeat_interleave(block_cols, dim=1)[:, first_col:first_col + cols]
    return (quantized.float() * scales).to(dtype)


def with_quantization_config(config: dict, arch: ArchitectureSpec, *, fp8: bool, block: int = BLOCK) -> dict:
    """A copy of an HF config.json dict whose `quantization_config` matches the weights that go
    with it: the FP8 entry for an FP8 export or FP8 rollout stream, none otherwise (the source may
    have been an FP8 checkpoint, DeepSeek-V3 is published so, while these weights are not; an
    engine reading the key would treat them as FP8)."""
    config = dict(config)
    if fp8:
        config["quantization_config"] = fp8_quantization_config(arch, block)
    else:
        config.pop("quantization_config", None)
    return config


def _quantized_pairs(pairs: Iterable[tuple[str, torch.Tensor]], quantized: frozenset[str], block: int):
    """The one quantization of every FP8 path: a name in `quantized` becomes (name, e4m3 weight)
    then (name + "_scale_inv", float32 scales); any other tensor passes as it is."""
    for name, tensor in pairs:
        if name in quantized:
            weight, scale_inv = quantize_blockwise(tensor, block)
            yield name, weight
            yield name + SCALE_SUFFIX, scale_inv
        else:
            yield name, tensor


def quantize_fp8_blockwise(
    buckets: Iterable[Bucket], arch: ArchitectureSpec, block: int = BLOCK
) -> Iterator[Bucket]:
    """Wrap an export stream: linear weights become (weight in FP8, weight_scale_inv), the rest passes.

    Buckets keep their boundaries (each shrinks: one byte per weight plus one scale per block),
    so the memory bound of the export is unchanged.
    """
    quantized = quantized_names(arch)
    for bucket in buckets:
        yield list(_quantized_pairs(bucket, quantized, block))


def fp8_rollout_stream(
    stream: Iterable[tuple[str, torch.Tensor]], arch: ArchitectureSpec, block: int = BLOCK
) -> Iterator[tuple[str, torch.Tensor]]:
    """Weight sync's flat (hf_name, tensor) stream (rollout.hf_weight_stream) as an FP8 engine
    loads it (model.export_fp8): each linear weight is followed by its `_scale_inv`, as in an FP8
    checkpoint, and every other tensor passes unchanged, at the dtype the stream was exported in
    (the engine's). Lazy: one weight is quantized at a time, on the device it arrived on, so the
    stream's memory bound holds. The engine's config.json needs the matching quantization_config
    (`with_quantization_config(raw, arch, fp8=True)`), else it loads FP8 bytes into BF16 weights."""
    yield from _quantized_pairs(stream, quantized_names(arch), block)
