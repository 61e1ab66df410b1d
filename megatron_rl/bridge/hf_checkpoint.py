"""Write an HF checkpoint directory (safetensors shards, index, config, tokenizer) from a live
sharded model. Each pipeline stage's leader writes its own shard files; rank 0 names them
`model-0000i-of-0000N.safetensors`, writes the index and the config.

With `fp8=True` the linear weights are written in block-wise FP8 with their scales and the
config gets the matching `quantization_config` (the HF FP8 checkpoint format; fp8_export.py).

Called inside an AtomicDirectory, so a failed export leaves no partial output.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megatron_rl.bridge.export import export_hf_weights
from megatron_rl.bridge.fp8_export import quantize_fp8_blockwise, with_quantization_config
from megatron_rl.model.hf_config import ArchitectureSpec, with_implied_keys

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json", "chat_template.jinja", "generation_config.json",
)
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def copy_tokenizer_files(source: str | Path | None, target: str | Path) -> list[str]:
    """The TOKENIZER_FILES `source` holds, copied into `target` (an engine's model directory, a
    checkpoint's hf_config/, an export), which are kept and shared. A file that is a symbolic link
    out of `source` (a downloaded model's `tokenizer_config.json -> ~/.netrc`) is refused by name:
    copied, the linked file's bytes would land in those outputs. A hub cache snapshot's links
    into its repository's blobs/ are followed (bridge/checked_read.outside)."""
    from megatron_rl.bridge.checked_read import outside
    from megatron_rl.errors import ConfigError

    if source is None:
        return []
    present = [name for name in TOKENIZER_FILES if (Path(source) / name).is_file()]
    for name in present:  # every one checked before any is copied
        problem = outside(Path(source), name)
        if problem is not None:
            path = Path(source) / name
            raise ConfigError(f"tokenizer file {path} {problem} (to {path.resolve()}); its bytes would be copied into "
                              f"{target}: put the file itself into {source}")
    for name in present:
        shutil.copy2(Path(source) / name, Path(target) / name)
    return present


def write_hf_checkpoint(
    module, arch: ArchitectureSpec, raw_config: dict, staging: Path, *,
    template_dir: str | Path | None = None, bucket_bytes: int = 2 << 30, dtype: torch.dtype | None = None,
    fp8: bool = False,
) -> None:
    """`fp8`: linear weights in block-wise FP8 with their scales (model.export_fp8; see fp8_export.py)."""
    from megatron.core import parallel_state as ps

    stage = ps.get_pipeline_model_parallel_rank()
    parts = []  # (file name, [tensor names], bytes)
    buckets = export_hf_weights(module, arch, bucket_bytes=bucket_bytes, dtype=dtype)
    if fp8:
        buckets = quantize_fp8_blockwise(buckets, arch)
    # One bucket alive at a time: with TP or EP > 1 its tensors are gathered copies, and the loop
    # variable (or enumerate's cached result tuple) would keep it until the next one is assembled.
    for bucket in buckets:
        file = f"part-stage{stage:03d}-{len(parts):05d}.safetensors"
        save_file({name: tensor.contiguous() for name, tensor in bucket}, str(staging / file), metadata={"format": "pt"})
        parts.append((file, [name for name, _ in bucket], sum(t.numel() * t.element_size() for _, t in bucket)))
        del bucket
    everyone = [parts]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, parts)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    ordered = sorted((p for rank_parts in everyone for p in rank_parts), key=lambda p: p[0])
    weight_map, total = {}, 0
    for index, (file, names, size) in enumerate(ordered, start=1):
        final = f"model-{index:05d}-of-{len(ordered):05d}.safetensors"
        (staging / file).rename(staging / final)
        weight_map.update({name: final for name in names})
        total += size
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    write_hf_config(raw_config, arch, staging, template_dir=template_dir, dtype=dtype, fp8=fp8)


def write_hf_config(raw_config: dict, arch: ArchitectureSpec, staging: Path, *, template_dir: str | Path | None,
                    dtype: torch.dtype | None = None, fp8: bool = False) -> None:
    """config.json (the keys transformers needs made explicit, the dtype when it changes, FP8's
    quantization_config or none) and the tokenizer files of `template_dir`, beside the weights."""
    config = with_implied_keys(raw_config, arch)
    if dtype is not None:
        # transformers 5 writes "dtype", 4.x "torch_dtype": keep the spelling the config uses.
        config["dtype" if "dtype" in config else "torch_dtype"] = DTYPE_NAMES[dtype]
    config = with_quantization_config(config, arch, fp8=fp8)
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copy_tokenizer_files(template_dir, staging)
