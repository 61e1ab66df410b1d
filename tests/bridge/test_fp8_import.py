"""Block-wise FP8 checkpoints (DeepSeek-V3/R1, Kimi-K2, our own FP8 export) are dequantized on import,
and multi-token-prediction layers are skipped.

Oracle: a float64 dequantization written here, block by block (no repeat_interleave, no scale
windows). The values of e4m3 (4 significant bits) times a float32 scale (24) are exact in float64,
so the fp32 model must hold exactly the float64 product rounded once to fp32.

- our FP8 export of a tiny Qwen3-MoE, imported back at TP2 x expert-TP2, equals its dequantization;
- a hand-made checkpoint whose rows and columns are not multiples of the block (128x128, and a
  non-square 48x80 block so rows and columns cannot be swapped unnoticed), with each TP rank's
  rows starting inside a block, equals its dequantization;
- DeepSeek-V3's own layout on the tiny DeepSeek-V3 family (MLA projections, shared experts, an MTP
  layer) imports to its dequantization;
- MTP layers are skipped with one message when config.json declares them, refused otherwise;
- a missing or misshapen scale, FP8 weights without a quantization_config and an infinite scale
  are refused by name.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from _support.processes import child_env, torchrun_command
from megatron_rl.bridge.fp8_export import dequantize_blockwise, fp8_quantization_config
from megatron_rl.model.hf_config import parse_hf_config

HERE = Path(__file__).parent
WORKER = HERE / "fp8_import_worker.py"
sys.path.insert(0, str(HERE))
from test_bridge import family_configs, make_hf_model  # noqa: E402

pytestmark = pytest.mark.multiprocess

FP8 = torch.float8_e4m3fn
TP2 = ["parallel.tp=2", "parallel.etp=2"]


def dequantize_f64(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The independent oracle: every block's fp8 values times that block's scale, in float64."""
    rows, cols = weight.shape
    out = torch.empty(rows, cols, dtype=torch.float64)
    for i in range(-(-rows // block[0])):
        for j in range(-(-cols // block[1])):
            r, c = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            out[r, c] = weight[r, c].to(torch.float64) * scale_inv[i, j].item()
    return out


def read_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for file in sorted(directory.glob("*.safetensors")) for k, v in load_file(file).items()}


def run_worker(model_dir: Path, out: Path, steps: list[str], overrides: list[str]) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    command = torchrun_command(WORKER, 2, "--model", str(model_dir), "--out", str(out), preloaded=True)
    for step in steps:
        command += ["--step", step]
    for item in overrides:
        command += ["--override", item]
    env = child_env()
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]
    return result


# ---- the scale window, alone ---------------------------------------------------------------------


@pytest.mark.parametrize("block", [(128, 128), (48, 80), (16, 16)])
def test_a_window_dequantizes_like_the_whole_tensor(block):
    """What each rank does: its rows and columns of the weight, the scales of the blocks they touch."""
    torch.manual_seed(0)
    weight = (torch.randn(300, 200) * 10).to(FP8)
    grid = (-(-300 // block[0]), -(-200 // block[1]))
    scale_inv = torch.rand(grid) * 2.0 ** torch.randint(-12, 4, grid)
    whole = dequantize_f64(weight, scale_inv, block)
    assert torch.equal(dequantize_blockwise(weight, scale_inv, block), whole.float())
    for (r0, r1), (c0, c1) in [((0, 300), (0, 200)), ((75, 150), (0, 200)), ((150, 300), (100, 200)),
                               ((129, 131), (47, 161)), ((299, 300), (199, 200))]:
        blocks = (slice(r0 // block[0], -(-r1 // block[0])), slice(c0 // block[1], -(-c1 // block[1])))
        window = dequantize_blockwise(weight[r0:r1, c0:c1], scale_inv[blocks], block, origin=(r0, c0))
        assert torch.equal(window, whole[r0:r1, c0:c1].float()), (block, r0, c0)


# ---- our FP8 export, imported back ---------------------------------------------------------------


def test_our_fp8_export_imports_back_to_its_dequantized_values(tmp_path):
    hf = tmp_path / "hf"
    make_hf_model(family_configs()["qwen3_moe"], hf)
    out = tmp_path / "out"
    run_worker(hf, out, [f"load:orig:{hf}", "fp8:fp8", f"load:reimported:{out / 'fp8'}"], TP2)

    original, fp8, reimported = read_checkpoint(hf), read_checkpoint(out / "fp8"), read_checkpoint(out / "reimported")
    assert not list(out.glob("*.error"))
    for name, tensor in read_checkpoint(out / "orig").items():
        assert torch.equal(tensor, original[name]), name  # the export started from the original weights
    config = json.loads((out / "fp8" / "config.json").read_text())
    arch = parse_hf_config(config)
    assert arch.fp8_block == (128, 128) and config["quantization_config"] == fp8_quantization_config(arch)
    assert sorted(reimported) == sorted(original)  # every *_scale_inv consumed, nothing else appeared
    scales = [name for name in fp8 if name.endswith("_scale_inv")]
    assert len(scales) > 20
    for name, tensor in original.items():
        if name + "_scale_inv" not in fp8:
            assert fp8[name].dtype == torch.float32 and torch.equal(reimported[name], tensor), name
            continue
        assert fp8[name].dtype == FP8
        want = dequantize_f64(fp8[name], fp8[name + "_scale_inv"], (128, 128))
        assert reimported[name].dtype == torch.float32
        assert torch.equal(reimported[name], want.float()), f"{name} is not its exact dequantization"
        assert not torch.equal(reimported[name], tensor), f"{name} was not quantized"  # the check has teeth


# ---- a hand-made checkpoint: dimensions that are not multiples of the block ---------------------

# q_proj [160, 200], k/v [80, 200], o_proj [200, 160], dense MLP [264, 200] / [200, 264], experts
# [136, 200] / [200, 136]: partial last blocks everywhere. At TP2 the second rank's q rows start at
# 80 and its expert rows at 68, inside a block, and its o_proj/down_proj columns likewise.
ODD = dict(family_configs()["qwen3_moe"], hidden_size=200, head_dim=40, intermediate_size=264,
           moe_intermediate_size=136)


def quantize_by_hand(weight: torch.Tensor, block: tuple[int, int], generator) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and one float32 scale per block, the scale a random multiple (1x to 4x) of the
    block's max/448 so it is not the scale our exporter would choose."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale_inv = torch.empty(grid, dtype=torch.float32)
    quantized = torch.empty(rows, cols, dtype=FP8)
    for i in range(grid[0]):
        for j in range(grid[1]):
            r, c = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            amax = weight[r, c].abs().max().item()
            scale_inv[i, j] = amax / 448 * (1 + 3 * torch.rand((), generator=generator).item())
            quantized[r, c] = (weight[r, c].double() / scale_inv[i, j].item()).to(FP8)
    return quantized, scale_inv


def write_checkpoint(directory: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def fp8_checkpoint(source: dict[str, torch.Tensor], block: tuple[int, int], seed: int) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's layout: the linear weights (*_proj, kv_a_proj_with_mqa) in e4m3 with scales;
    norms, embeddings, lm_head, the router gate and its correction bias as they are, in BF16."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, tensor in source.items():
        if name.endswith(("_proj.weight", "_proj_with_mqa.weight")):
            tensors[name], tensors[name + "_scale_inv"] = quantize_by_hand(tensor, block, generator)
        else:
            tensors[name] = tensor.bfloat16()
    return tensors


def mtp_tensors(source: dict[str, torch.Tensor], layer: int, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """A DeepSeek-V3 multi-token-prediction layer `layer` (right after the decoder layers): embedding,
    enorm/hnorm, eh_proj, shared head and a decoder layer (a copy of the last one), its linear
    weights in FP8 with scales."""
    hidden = source["model.norm.weight"].shape[0]
    last = f"model.layers.{layer - 1}."
    extra = {f"model.layers.{layer}.{name.removeprefix(last)}": t for name, t in source.items() if name.startswith(last)}
    extra.update({
        f"model.layers.{layer}.embed_tokens.weight": source["model.embed_tokens.weight"],
        f"model.layers.{layer}.enorm.weight": torch.ones(hidden),
        f"model.layers.{layer}.hnorm.weight": torch.ones(hidden),
        f"model.layers.{layer}.eh_proj.weight": torch.randn(hidden, 2 * hidden) * 0.05,
        f"model.layers.{layer}.shared_head.norm.weight": torch.ones(hidden),
        f"model.layers.{layer}.shared_head.head.weight": source["lm_head.weight"],
    })
    return fp8_checkpoint(extra, block, seed=7)


@pytest.fixture(scope="module")
def odd_model(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    directory = tmp_path_factory.mktemp("odd") / "hf"
    make_hf_model(ODD, directory)
    return directory, read_checkpoint(directory)


def test_hand_made_checkpoints_partial_blocks_mtp_and_refusals(odd_model, tmp_path):
    hf, source = odd_model
    checkpoints = {}  # name -> (directory, tensors)

    def make(name: str, config: dict, tensors: dict[str, torch.Tensor]) -> None:
        checkpoints[name] = (write_checkpoint(tmp_path / name, config, tensors), tensors)

    square, oblong = (128, 128), (48, 80)
    fp8_config = dict(ODD, quantization_config=dict(fp8_quantization_config(parse_hf_config(ODD)),
                                                    weight_block_size=list(square)))
    make("square", fp8_config, fp8_checkpoint(source, square, seed=1))
    make("oblong", dict(fp8_config, quantization_config=dict(fp8_config["quantization_config"],
                                                              weight_block_size=list(oblong))),
         fp8_checkpoint(source, oblong, seed=2))
    base = checkpoints["square"][1]
    layers = ODD["num_hidden_layers"]
    mtp = mtp_tensors(source, layers, square)
    make("mtp_skipped", dict(fp8_config, num_nextn_predict_layers=1), {**base, **mtp})
    make("mtp_refused", fp8_config, {**base, **mtp})
    make("mtp_too_far", dict(fp8_config, num_nextn_predict_layers=1),
         {**base, **mtp, f"model.layers.{layers + 1}.enorm.weight": torch.ones(ODD["hidden_size"])})
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    make("missing_scale", fp8_config, {n: t for n, t in base.items() if n != k_proj + "_scale_inv"})
    make("no_quantization_config", ODD, base)
    make("scale_shape", fp8_config, {**base, k_proj + "_scale_inv": torch.ones(2, 2)})
    down = "model.layers.1.mlp.down_proj.weight"
    infinite = base[down + "_scale_inv"].clone()
    infinite[0, -1] = float("inf")
    make("infinite_scale", fp8_config, {**base, down + "_scale_inv": infinite})

    out = tmp_path / "out"
    result = run_worker(hf, out, [f"load:{name}:{directory}" for name, (directory, _) in checkpoints.items()], TP2)

    # Values: each quantized tensor is exactly its float64 dequantization, the rest as stored.
    for name, block in (("square", square), ("oblong", oblong)):
        assert not (out / f"{name}.error").exists(), (out / f"{name}.error").read_text()
        stored, loaded = checkpoints[name][1], read_checkpoint(out / name)
        assert sorted(loaded) == sorted(source)
        partial = 0
        for tensor_name in source:
            if tensor_name + "_scale_inv" in stored:
                weight = stored[tensor_name]
                partial += any(n % b for n, b in zip(weight.shape, block))
                want = dequantize_f64(weight, stored[tensor_name + "_scale_inv"], block).float()
            else:
                want = stored[tensor_name].float()
            assert torch.equal(loaded[tensor_name], want), f"{name}: {tensor_name}"
        assert partial > 10  # the point of this checkpoint: partial blocks on most weights

    # Multi-token prediction: skipped, with one message, when config.json declares the layer.
    assert not (out / "mtp_skipped.error").exists(), (out / "mtp_skipped.error").read_text()
    loaded = read_checkpoint(out / "mtp_skipped")
    assert all(torch.equal(loaded[n], t) for n, t in read_checkpoint(out / "square").items())
    message = (f"skipping {len(mtp)} multi-token-prediction tensors (model.layers.{layers}.*): "
               "not used for RL training")
    assert result.stdout.count("multi-token-prediction") == 1 and message in result.stdout, result.stdout[-3000:]
    refusals = {
        "mtp_refused": f"tensor {sorted(mtp)[0]} (and {len(mtp) - 1} more) is not used by Qwen3MoeForCausalLM",
        "mtp_too_far": f"tensor model.layers.{layers + 1}.enorm.weight is not used by Qwen3MoeForCausalLM",
        "missing_scale": f"tensor {k_proj} is stored as F8_E4M3 but its scale {k_proj}_scale_inv is missing",
        "no_quantization_config": "_proj.weight is stored as F8_E4M3, but config.json has no block-wise FP8 "
                                  "quantization_config to dequantize it with",
        "scale_shape": f"tensor {k_proj}_scale_inv has shape [2, 2] in the checkpoint but {k_proj} of shape "
                       "[80, 200] in blocks of [128, 128] (quantization_config.weight_block_size) needs [1, 2]",
        "infinite_scale": f"tensor {down} (dequantized with {down}_scale_inv) holds NaN or infinite values",
    }
    for name, message in refusals.items():
        error = out / f"{name}.error"
        assert error.exists() and not (out / name).exists(), f"{name} was not refused"
        assert message in error.read_text(), (name, error.read_text())


def test_deepseek_v3_fp8_checkpoint_with_its_mtp_layer(tmp_path):
    """The published format on the family it comes from: MLA projections (kv_a_proj_with_mqa's
    latent + rope rows split over TP inside a block), shared and routed experts in FP8 with
    16x24 blocks, the router's correction bias unquantized, an MTP layer skipped."""
    raw = family_configs()["deepseek_v3"]
    hf = tmp_path / "hf"
    make_hf_model(raw, hf)
    source = read_checkpoint(hf)
    block = (16, 24)
    layers = raw["num_hidden_layers"]
    quantized = fp8_checkpoint(source, block, seed=3)
    mtp = mtp_tensors(source, layers, block)
    config = dict(raw, num_nextn_predict_layers=1, quantization_config=dict(
        quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=list(block)))
    fp8_dir = write_checkpoint(tmp_path / "fp8", config, {**quantized, **mtp})
    assert {"model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv",
            "model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv",
            "model.layers.1.mlp.experts.7.down_proj.weight_scale_inv"} <= set(quantized)

    out = tmp_path / "out"
    result = run_worker(hf, out, [f"load:ds:{fp8_dir}"], TP2)
    assert not (out / "ds.error").exists(), (out / "ds.error").read_text()
    loaded = read_checkpoint(out / "ds")
    assert sorted(loaded) == sorted(source)
    # Written back at the training precision: the FP8 source's quantization_config must not follow.
    assert "quantization_config" not in json.loads((out / "ds" / "config.json").read_text())
    for name in source:
        if name + "_scale_inv" in quantized:
            want = dequantize_f64(quantized[name], quantized[name + "_scale_inv"], block).float()
        else:
            want = quantized[name].float()
        assert torch.equal(loaded[name], want), name
    assert f"skipping {len(mtp)} multi-token-prediction tensors (model.layers.{layers}.*)" in result.stdout
