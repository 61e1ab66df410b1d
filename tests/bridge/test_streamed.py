"""The streamed conversions (bridge/streamed.py) against the live model, and their memory.

- hf-to-megatron, which builds the model on the meta device and reads each weight only while the
  writer writes it, writes the same torch_dist files, byte for byte, as Megatron-Core's save of the
  live model filled from the same HF checkpoint at the same layout (TP2 x EP2);
- what it saved at another layout (EP2 x PP2) loads into the live model at TP2 x EP2 and exports
  the original HF tensors;
- neither conversion's memory grows with the model: converting a model of ~400 MB of weights needs
  less than a quarter of that more than converting a tiny one (peak anonymous memory, read from
  /proc while the tool runs; the four runs forked from one fresh process after their imports,
  conversion_memory_worker.py). Building the model, as the conversions did before, costs all of it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from _support.processes import REPO, child_env, python_command, torchrun_command

sys.path.insert(0, str(Path(__file__).parent))
from test_bridge import family_configs, make_hf_model, read_checkpoint  # noqa: E402

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("streamed_worker.py")
MEMORY_WORKER = Path(__file__).with_name("conversion_memory_worker.py")
ENV = child_env()


def tool(name: str, *args: str) -> None:
    result = subprocess.run(python_command(REPO / "tools" / name, *args, preloaded=True, children=True), env=ENV,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{name} {args}:\n{result.stderr[-4000:]}"


def test_streamed_save_is_the_live_save_and_loads_at_another_layout(tmp_path):
    hf = tmp_path / "hf"
    make_hf_model(family_configs()["qwen3_moe"], hf)
    same, other = tmp_path / "streamed_tp2_ep2", tmp_path / "streamed_ep2_pp2"
    tool("convert_hf_to_megatron.py", "--hf-dir", str(hf), "--out", str(same), "--tp", "2", "--ep", "2", "--etp", "1")
    tool("convert_hf_to_megatron.py", "--hf-dir", str(hf), "--out", str(other), "--ep", "2", "--pp", "2", "--etp", "1")
    live, export = tmp_path / "live", tmp_path / "export.pt"
    live.mkdir()
    result = subprocess.run(
        torchrun_command(WORKER, 2, "--hf", str(hf), "--streamed", str(other), "--live-out", str(live),
                         "--export", str(export), "--tp", "2", "--ep", "2", "--etp", "1", preloaded=True),
        env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]

    files = sorted(path.name for path in live.glob("*.distcp"))
    assert files == sorted(path.name for path in same.glob("*.distcp")) and len(files) == 2
    for name in files:
        assert (same / name).read_bytes() == (live / name).read_bytes(), name
    streamed_index, live_index = (FileSystemReader(str(d)).read_metadata() for d in (same, live))
    assert streamed_index.storage_data == live_index.storage_data
    assert streamed_index.state_dict_metadata.keys() == live_index.state_dict_metadata.keys()

    original, exported = read_checkpoint(hf), torch.load(export)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


# ---- memory ---------------------------------------------------------------------------------------


def conversions_peaks(models: list[tuple[Path, Path]]) -> list[tuple[int, int]]:
    """Per (HF directory, work directory): the peak anonymous memory of hf-to-megatron and of
    megatron-to-hf (16 MiB buckets) on it, each run forked from one fresh process after the
    conversions' imports (conversion_memory_worker.py); the round trip returns the HF tensors."""
    tools = REPO / "tools"
    commands = []
    for hf, work in models:
        commands += ["--", str(tools / "convert_hf_to_megatron.py"), "--hf-dir", str(hf), "--out", str(work / "mcore"),
                     "--", str(tools / "convert_megatron_to_hf.py"), "--ckpt", str(work / "mcore"),
                     "--out", str(work / "back"), "--bucket-mb", "16"]
    out = models[0][1] / "peaks.json"
    # A fresh process, not the pre-imported server: the forks' resident memory starts with their parent's.
    result = subprocess.run(python_command(MEMORY_WORKER, out, *commands[1:]), env=ENV, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    peaks = json.loads(out.read_text())
    for hf, work in models:
        original, returned = read_checkpoint(hf), read_checkpoint(work / "back")
        assert sorted(original) == sorted(returned)
        assert all(torch.equal(original[name], returned[name]) for name in original)
    return [(peaks[2 * i], peaks[2 * i + 1]) for i in range(len(models))]


def test_conversions_memory_does_not_grow_with_the_model(tmp_path):
    tiny = tmp_path / "tiny"
    make_hf_model(family_configs()["qwen3_moe"], tiny)
    # ~100M parameters in fp32 (~400 MB), none larger than 4 MB: 4 MoE layers of 64 experts.
    large = tmp_path / "large"
    make_hf_model(dict(family_configs()["qwen3_moe"], hidden_size=256, num_hidden_layers=4, num_experts=64,
                       moe_intermediate_size=512, intermediate_size=512, mlp_only_layers=[], vocab_size=4096), large)
    weights = sum(file.stat().st_size for file in large.glob("*.safetensors"))
    assert weights > 380e6
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (small_there, small_back), (large_there, large_back) = conversions_peaks([(tiny, tmp_path / "a"),
                                                                             (large, tmp_path / "b")])
    grown = {"hf-to-megatron": large_there - small_there, "megatron-to-hf": large_back - small_back}
    # A conversion that built the model would grow by all of `weights`; the streamed ones hold one
    # tensor (hf-to-megatron) or one 16 MiB bucket (megatron-to-hf) of weights at a time.
    for direction, extra in grown.items():
        assert extra < weights / 4, f"{direction}: {extra / 2**20:.0f} MiB more for {weights / 2**20:.0f} MiB of weights"
