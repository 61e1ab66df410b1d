"""checkpoint/base_ref.py and base_check.py on files, in process: how a LoRA checkpoint names its base, and every
way the base can differ from what the run read (tests/model/test_lora.py and
tests/train/test_lora_rl.py load real checkpoints over real bases)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from megatron_rl.checkpoint import base_check, base_ref
from megatron_rl.errors import ConfigError


def hf_base(root: Path) -> Path:
    base = root / "hf"
    (base / ".cache").mkdir(parents=True)
    (base / "config.json").write_text('{"model_type": "qwen3"}')
    (base / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (base / ".cache" / "download.lock").write_text("a download's lock")
    (base / "README.md").write_text("a model card, which may be edited")
    return base


def test_a_hf_base_is_named_by_path_with_the_files_that_make_the_model(tmp_path):
    base = hf_base(tmp_path)
    reference = base_ref.describe_source(base)
    assert reference["kind"] == "hf" and reference["path"] == str(base.resolve())
    assert sorted(reference["files"]) == ["config.json", "model.safetensors"]  # not the card, not the cache
    data = (base / "model.safetensors").read_bytes()
    assert reference["files"]["model.safetensors"] == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    assert base_check.base_problem(reference, tmp_path / "anywhere") is None  # absolute: from any checkpoint


def test_a_checkpoint_that_refers_to_a_base_passes_that_base_on(tmp_path):
    """init_from a LoRA checkpoint: the new run's base is that checkpoint's base, absolute."""
    base = hf_base(tmp_path)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000004"
    ckpt.mkdir(parents=True)
    (ckpt / "weights").mkdir()
    relative = dict(base_ref.describe_source(base), path="../../../hf")
    (ckpt / "megatron_rl.json").write_text(json.dumps({"format": "megatron_rl.torch_dist.v1", "weights_dir": "weights",
                                                      "padded_vocab_size": 128, "base": relative}))
    assert base_check.locate(relative, ckpt) == tmp_path / "hf"  # no "step_000004/../" left in names
    passed_on = base_ref.describe_source(ckpt)
    assert passed_on == dict(relative, path=str(base.resolve()))
    # a checkpoint inside the run's checkpoints keeps the relative name, one elsewhere gets the absolute
    assert base_check.portable(relative, ckpt, ckpt.parent) == relative
    assert base_check.portable(relative, ckpt, tmp_path / "other" / "checkpoints")["path"] == str(base.resolve())


@pytest.mark.parametrize("change, named", [
    ("missing", "model.safetensors is missing"),
    ("longer", "model.safetensors has 1025 bytes, 1024 when the run read it"),
    ("flipped", "model.safetensors has CRC-32 "),
    ("moved", "does not exist (moved or deleted?)"),
])
def test_every_change_of_the_base_is_refused_naming_the_file(tmp_path, change, named):
    base = hf_base(tmp_path)
    reference = base_ref.describe_source(base)
    weights = base / "model.safetensors"
    if change == "missing":
        weights.unlink()
    elif change == "longer":
        weights.write_bytes(weights.read_bytes() + b"\0")
    elif change == "flipped":
        data = bytearray(weights.read_bytes())
        data[100] ^= 1
        weights.write_bytes(bytes(data))
    else:
        base.rename(tmp_path / "elsewhere")
    with pytest.raises(ConfigError) as refused:
        base_check.check_base(reference, tmp_path / "run" / "checkpoints" / "step_000002")
    message = str(refused.value)
    assert named in message and str(base) in message and "step_000002" in message, message
    if change == "flipped":  # same size: the preflight's size check passes, the CRC-32 does not
        assert base_check.base_problem(reference, tmp_path, checksums=False) is None


@pytest.mark.parametrize("entry, named", [
    ("not an object", '"base" must be an object with a "path"'),
    ({"path": "/x", "files": {}}, '"base" must list its "files"'),
    ({"path": "/x", "files": {"../../etc/passwd": {"bytes": 1, "crc32": "0"}}}, "lies outside the base"),
    ({"path": "/x", "files": {"config.json": {"bytes": "1"}}}, 'needs "bytes" and "crc32"'),
])
def test_a_malformed_base_entry_is_refused_not_followed(tmp_path, entry, named):
    """megatron_rl.json is untrusted input: an entry of the wrong shape, or one naming files
    outside the base, is refused before any file is read."""
    problem = base_check.base_problem(entry, tmp_path)
    assert problem is not None and named in problem and "edited or damaged" in problem, problem
