"""How large a conversion's output will be, about, from its input's sizes (read, not its weights):
`megatron-rl convert` refuses an output whose filesystem has less room (tools/convert.py)."""

from __future__ import annotations

from pathlib import Path

from megatron_rl.checkpoint.format import weights_path

# Bytes per parameter of a checkpoint's dtype (config.json) and of a Megatron precision.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PRECISION_BYTES = {"fp32": 4, "bf16": 2}


def hf_to_megatron_bytes(hf_dir: str | Path, raw: dict, precision: str) -> int:
    """The torch_dist output's size, about: the safetensors files scaled from the checkpoint's
    dtype to `precision` (a bf16 model converted to fp32 doubles), plus the tokenizer files."""
    hf_dir = Path(hf_dir)
    weights = sum(file.stat().st_size for file in hf_dir.glob("*.safetensors"))
    source = DTYPE_BYTES.get(raw.get("dtype") or raw.get("torch_dtype") or "float32", 2)
    return weights * PRECISION_BYTES[precision] // source + _tokenizer_bytes(hf_dir)


def megatron_to_hf_bytes(ckpt: Path, template_dir: str | Path) -> int:
    """The safetensors output's size, about: the model's tensors in the torch_dist index (the
    index is read, not the weights), plus the tokenizer files. A training checkpoint also stores
    Adam's moments, fp32 main weights and the KL reference, each under the weight's own key with
    a prefix (optimizer.exp_avg.KEY, reference.KEY: model/optimizer_state.keyed_like); those are
    not exported, so a key that ends in another key is left out."""
    from megatron_rl.checkpoint.unpickling import read_torch_dist_index

    try:
        storage = read_torch_dist_index(weights_path(ckpt)).storage_data
    except Exception:
        return 0  # an unreadable or refused index: check_weight_files names it next
    names = {index.fqn.split("/")[0] for index in storage}
    weights = {name for name in names if not _keyed_like_another(name, names)}
    model = sum(item.length for index, item in storage.items() if index.fqn.split("/")[0] in weights)
    return model + _tokenizer_bytes(template_dir)


def _keyed_like_another(name: str, names: set[str]) -> bool:
    parts = name.split(".")
    return any(".".join(parts[i:]) in names for i in range(1, len(parts)))


def _tokenizer_bytes(directory: str | Path) -> int:
    from megatron_rl.bridge.hf_checkpoint import TOKENIZER_FILES

    files = [Path(directory) / name for name in (*TOKENIZER_FILES, "config.json")]
    return sum(file.stat().st_size for file in files if file.is_file())
