"""bridge/safetensors_stream.py: files written one tensor at a time read back by the safetensors
library itself, with the checksums the manifest takes from them."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from megatron_rl.bridge.safetensors_stream import SafetensorsStream, plan_files
from megatron_rl.checkpoint.store import file_crc32


def tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(40, 16, generator=generator).to(torch.bfloat16),
        "model.norm.weight": torch.randn(16, generator=generator),
        "model.layers.0.mlp.gate.e_score_correction_bias": torch.randn(4, generator=generator),
        "scalar": torch.tensor(3.5),  # 0-dim
        "empty": torch.zeros(0, 16, dtype=torch.bfloat16),
        "fp8": torch.randn(8, 8, generator=generator).to(torch.float8_e4m3fn),
        "half": torch.randn(3, 5, generator=generator).half(),
        "column_slice": torch.randn(16, 8, generator=generator)[:, 2:6],  # not contiguous
    }


def planned(values: dict[str, torch.Tensor], file_bytes: int):
    return plan_files([(name, t.dtype, tuple(t.shape)) for name, t in values.items()], file_bytes)


def test_streamed_files_read_back_with_safetensors(tmp_path):
    values = tensors()
    files = planned(values, file_bytes=300)  # the embedding (1280 bytes) alone; the rest split by size
    assert len(files) >= 3 and files[0].tensors[0][0] == "model.embed_tokens.weight" and len(files[0].tensors) == 1
    with SafetensorsStream(tmp_path, files) as out:
        for name, tensor in values.items():
            out.write(name, tensor)
    read = {}
    for planned_file in files:
        with safe_open(str(tmp_path / planned_file.name), "pt") as handle:
            assert handle.metadata() == {"format": "pt"}
            read.update({name: handle.get_tensor(name) for name in handle.keys()})
    assert sorted(read) == sorted(values)
    for name, tensor in values.items():
        assert read[name].dtype == tensor.dtype and read[name].shape == tensor.shape, name
        assert torch.equal(read[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
    # Checksums taken while writing are the ones the manifest would compute by reading.
    assert sorted(out.checksums) == sorted(f.name for f in files)
    for name, entry in out.checksums.items():
        assert entry == {"bytes": (tmp_path / name).stat().st_size, "crc32": file_crc32(tmp_path / name)}
    index = out.index()
    assert index["weight_map"]["model.norm.weight"] in out.checksums
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in values.values())
    assert [f.name for f in files][-1] == f"model-{len(files):05d}-of-{len(files):05d}.safetensors"


def test_a_tensor_out_of_plan_is_refused_before_it_is_written(tmp_path):
    values = tensors()
    files = planned(values, file_bytes=1 << 20)
    with pytest.raises(RuntimeError, match="planned model.embed_tokens.weight"):
        with SafetensorsStream(tmp_path, files) as out:
            out.write("model.norm.weight", values["model.norm.weight"])  # out of order
    assert not any(tmp_path.iterdir())
    with pytest.raises(RuntimeError, match=r"planned model.embed_tokens.weight torch.bfloat16 \[40, 16\]"):
        with SafetensorsStream(tmp_path, files) as out:
            out.write("model.embed_tokens.weight", values["model.embed_tokens.weight"].float())  # dtype
    with pytest.raises(RuntimeError, match="closed before tensor model.norm.weight was written"):
        with SafetensorsStream(tmp_path, files) as out:
            out.write("model.embed_tokens.weight", values["model.embed_tokens.weight"])
