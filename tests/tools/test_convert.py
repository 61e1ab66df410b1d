"""tools/convert_hf_to_megatron.py and tools/convert_megatron_to_hf.py, run as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).parents[2]
sys.path.insert(0, str(REPO / "tests" / "bridge"))
from test_bridge import family_configs, hf_logits, make_hf_model, read_checkpoint  # noqa: E402


def tool(name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(REPO / "tools" / name), *args], env=env,
                            capture_output=True, text=True, timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"{name} {args} failed:\n{result.stderr[-5000:]}")
    return result


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    # vocab 600 pads to 640 rows at TP1 and 768 at TP2: the checkpoint must carry its padding.
    path = tmp_path_factory.mktemp("hf") / "llama"
    make_hf_model(dict(family_configs()["llama"], vocab_size=600), path)
    return path


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "qwen3_moe"
    make_hf_model(family_configs()["qwen3_moe"], path)
    return path


def assert_same_checkpoint(a: Path, b: Path) -> None:
    left, right = read_checkpoint(a), read_checkpoint(b)
    assert sorted(left) == sorted(right)
    for name in left:
        assert left[name].dtype == right[name].dtype and torch.equal(left[name], right[name]), name


def test_tp2_checkpoint_converts_back_at_tp1(llama, tmp_path):
    tool("convert_hf_to_megatron.py", "--hf-dir", str(llama), "--out", str(tmp_path / "mcore"), "--tp", "2")
    metadata = json.loads((tmp_path / "mcore" / "megatron_rl.json").read_text())
    assert metadata["padded_vocab_size"] == 768 and metadata["saved_layout"]["tp"] == 2
    tool("convert_megatron_to_hf.py", "--ckpt", str(tmp_path / "mcore"), "--out", str(tmp_path / "back"))
    assert_same_checkpoint(llama, tmp_path / "back")
    tokens = [1, 5, 599, 42, 7]
    assert torch.equal(hf_logits(tmp_path / "back", tokens), hf_logits(llama, tokens))


def test_moe_saved_at_ep2_pp2_loads_at_tp2(moe, tmp_path):
    tool("convert_hf_to_megatron.py", "--hf-dir", str(moe), "--out", str(tmp_path / "mcore"),
         "--ep", "2", "--pp", "2", "--etp", "1")
    tool("convert_megatron_to_hf.py", "--ckpt", str(tmp_path / "mcore"), "--out", str(tmp_path / "back"),
         "--tp", "2", "--etp", "2", "--hf-template", str(moe))
    assert_same_checkpoint(moe, tmp_path / "back")


def test_cli_wrapper(llama, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "convert", "hf-to-megatron",
                             "--hf-dir", str(llama), "--out", str(tmp_path / "mcore")],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "mcore" / "metadata.json").is_file()


def test_unknown_architecture_lists_supported(tmp_path):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    result = tool("convert_hf_to_megatron.py", "--hf-dir", str(tmp_path / "gpt2"), "--out", str(tmp_path / "o"), check=False)
    assert result.returncode == 2
    assert "'GPT2LMHeadModel' is not supported; supported: Qwen3MoeForCausalLM" in result.stderr
    assert not (tmp_path / "o").exists()


def test_existing_output_needs_force(llama, tmp_path):
    out = tmp_path / "mcore"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    result = tool("convert_hf_to_megatron.py", "--hf-dir", str(llama), "--out", str(out), check=False)
    assert result.returncode == 2 and "already exists; pass --force" in result.stderr
    assert (out / "keep.txt").read_text() == "precious"
    tool("convert_hf_to_megatron.py", "--hf-dir", str(llama), "--out", str(out), "--force")
    assert not (out / "keep.txt").exists() and (out / "megatron_rl.json").is_file()


def test_failed_conversion_leaves_no_partial_output(llama, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in llama.iterdir():
        if file.suffix == ".safetensors":
            tensors = load_file(file)
            tensors.pop("model.layers.1.mlp.up_proj.weight")
            save_file(tensors, broken / file.name, metadata={"format": "pt"})
        else:
            (broken / file.name).write_bytes(file.read_bytes())
    result = tool("convert_hf_to_megatron.py", "--hf-dir", str(broken), "--out", str(tmp_path / "out"), "--tp", "2", check=False)
    assert result.returncode != 0
    assert "tensor model.layers.1.mlp.up_proj.weight is missing" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]  # no output, no staging left
