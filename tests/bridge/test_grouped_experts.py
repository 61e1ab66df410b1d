"""Transformer Engine's grouped-GEMM experts (TEGroupedMLP) through the bridge, without a GPU.

TE cannot be built here, so the grouped layout is checked two ways:
- on names and shapes: a TE grouped-expert parameter table (per-expert weight{i}, tagged the way
  TE tags them) canonicalizes to local-spec names whose gathered shapes split into the HF shapes;
- on values (subprocesses, torchrun): a local-spec model's parameters renamed and re-tagged as the
  TE spec names them (grouped_worker.TransformerEngineView) export exactly the HF tensors the
  local layout exports, an HF checkpoint imports through that view, and an FP8 export written
  through it dequantizes to the original weights within e4m3 rounding.
The layouts include expert-TP = 2, where TE tags linear_fc2 with the wrong split dimension.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.bridge.fp8_export import dequantize_blockwise, fp8_quantization_config, quantized_names
from megatron_rl.bridge.layouts import split
from megatron_rl.bridge.mappings import expand
from megatron_rl.bridge.placement import canonical_name, tp_split_dim
from megatron_rl.model.hf_config import load_hf_config, parse_hf_config

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("grouped_worker.py")


def hf_config() -> dict:
    raw, _ = load_hf_config("tiny-qwen3-moe")
    # Layer 1 dense: the TE spec fuses its pre-MLP norm into linear_fc1, unlike the MoE layer's.
    return dict(raw, vocab_size=500, mlp_only_layers=[1])


def te_expert_table(arch, etp: int, ep: int) -> list[tuple[str, tuple[int, int], int]]:
    """(name, shape, partition_dim attribute) of layer 0's grouped experts on one rank, as TE builds them."""
    explicit_comm = etp > 1 or ep > 1  # then Megatron passes parallel_mode=None and TE tags dim 0
    ffn, hidden = arch.moe_ffn_hidden_size // etp, arch.hidden_size
    rows = []
    for i in range(arch.num_experts // ep):
        rows.append((f"decoder.layers.0.mlp.experts.linear_fc1.weight{i}", (2 * ffn, hidden), 0))
    for i in range(arch.num_experts // ep):
        rows.append((f"decoder.layers.0.mlp.experts.linear_fc2.weight{i}", (hidden, ffn), 0 if explicit_comm else 1))
    return rows


@pytest.mark.parametrize("etp, ep", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_grouped_expert_names_and_shapes_map_to_hf(etp, ep):
    arch = parse_hf_config(hf_config())
    table = {name: (hf, layout) for name, hf, layout in expand(arch)}
    hf_shapes = {"gate_proj": (arch.moe_ffn_hidden_size, arch.hidden_size),
                 "up_proj": (arch.moe_ffn_hidden_size, arch.hidden_size),
                 "down_proj": (arch.hidden_size, arch.moe_ffn_hidden_size)}
    for name, shape, partition_dim in te_expert_table(arch, etp, ep):
        param = torch.empty(shape)
        param.tensor_model_parallel, param.partition_dim = True, partition_dim
        local = canonical_name(name)
        assert ".mlp.experts.local_experts." in local and local in table, local
        dim = tp_split_dim(local, param)
        full = torch.empty([n * etp if d == dim else n for d, n in enumerate(shape)])  # gathered over expert-TP
        hf_names, layout = table[local]
        pieces = split(layout, full, arch)
        assert [tuple(p.shape) for p in pieces] == [hf_shapes[n.split(".")[-2]] for n in hf_names], (name, etp, ep)


def make_hf_model(directory: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = hf_config()
    torch.manual_seed(0)
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(raw["model_type"], **fields))
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Norms away from 1, so a norm mapped to the wrong place changes the exported values.
            param.copy_(1 + 0.2 * torch.randn_like(param) if "norm" in name else 0.08 * torch.randn_like(param))
    model.save_pretrained(directory)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("hf") / "qwen3_moe"
    make_hf_model(directory)
    return directory


def read_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for file in sorted(directory.glob("*.safetensors")) for k, v in load_file(file).items()}


LAYOUTS = {
    "etp2": (2, ["parallel.tp=2", "parallel.etp=2"]),  # TE tags linear_fc2 partition_dim=0, split along 1
    "ep2": (2, ["parallel.ep=2", "parallel.etp=1"]),  # grouped weight{i} -> global expert ids
    "tp1-etp2": (2, ["parallel.etp=2"]),  # experts split over expert-TP with TP = 1 and EP = 1
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grouped_layout_exports_and_imports_like_the_local_layout(hf_dir, rank_pools, tmp_path, layout):
    nproc, overrides = LAYOUTS[layout]
    args = ["--hf", str(hf_dir), "--out", str(tmp_path)]
    for item in overrides:
        args += ["--override", item]
    result = rank_pools.run(WORKER, nproc, *args)
    assert result.returncode == 0, result.stderr[-6000:]

    original = read_checkpoint(hf_dir)
    for key in ("local", "grouped", "reloaded"):
        tensors = torch.load(tmp_path / f"{key}.pt")
        assert sorted(tensors) == sorted(original), key
        for name, tensor in original.items():
            assert torch.equal(tensors[name], tensor), f"{key}: {name} differs from the HF checkpoint"

    arch = parse_hf_config(hf_config())
    fp8 = read_checkpoint(tmp_path / "hf_fp8")
    quantized = quantized_names(arch)
    assert sorted(fp8) == sorted(list(original) + [n + "_scale_inv" for n in quantized])
    for name, tensor in original.items():
        if name not in quantized:
            assert torch.equal(fp8[name], tensor), name
            continue
        assert fp8[name].dtype == torch.float8_e4m3fn and fp8[name + "_scale_inv"].dtype == torch.float32
        restored = dequantize_blockwise(fp8[name], fp8[name + "_scale_inv"])
        assert ((restored - tensor).abs() <= tensor.abs() * 2**-4 + tensor.abs().max() / 448 * 2**-10).all(), name
    config = json.loads((tmp_path / "hf_fp8" / "config.json").read_text())
    assert config["quantization_config"] == fp8_quantization_config(arch)
    index = json.loads((tmp_path / "hf_fp8" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(fp8)
