"""Build decisions made before any model exists: layer spec, FP8, vocab padding, CPU layer."""

import pytest
import torch

from megatron_rl.config import ModelConfig, load_config

from megatron_rl.errors import ConfigError
from megatron_rl.model.builder import check_fp8, padded_vocab_size, transformer_config, use_transformer_engine
from megatron_rl.model.hf_config import load_hf_config, parse_hf_config

CPU = torch.device("cpu")


@pytest.mark.parametrize("recipe", ["delayed", "current", "blockwise", "mxfp8"])
def test_fp8_is_refused_on_cpu_with_a_clear_message(recipe):
    with pytest.raises(ConfigError) as info:
        check_fp8(ModelConfig(fp8_recipe=recipe, precision="bf16"), CPU, use_te=False)
    message = str(info.value)
    assert f"model.fp8_recipe='{recipe}'" in message and "Transformer Engine" in message and "cpu" in message


def test_fp8_refusal_happens_before_building():
    config = load_config(None, ["model.fp8_recipe=blockwise", "model.precision=bf16"])
    arch = parse_hf_config(*load_hf_config(config.model.hf_config))
    with pytest.raises(ConfigError, match="fp8_recipe"):
        transformer_config(arch, config, CPU, use_te=False)


def test_layer_spec_selection_on_cpu():
    assert use_transformer_engine(ModelConfig(layer_spec="auto"), CPU) is False
    assert use_transformer_engine(ModelConfig(layer_spec="local"), CPU) is False
    with pytest.raises(ConfigError, match="layer_spec=transformer_engine needs CUDA"):
        use_transformer_engine(ModelConfig(layer_spec="transformer_engine"), CPU)


def test_layer_spec_auto_picks_te_when_present_mocked(monkeypatch):
    """Mocked: no GPU or Transformer Engine here; checks only the selection rule."""
    from megatron_rl.model import builder

    monkeypatch.setattr(builder, "transformer_engine_available", lambda: True)
    assert use_transformer_engine(ModelConfig(layer_spec="auto"), torch.device("cuda", 0)) is True
    assert use_transformer_engine(ModelConfig(layer_spec="local"), torch.device("cuda", 0)) is False


def test_padded_vocab():
    assert padded_vocab_size(151936, 128, 1) == 151936
    assert padded_vocab_size(151936, 128, 8) == 152576
    assert padded_vocab_size(500, 128, 2) == 512


def test_layout_rejections_from_the_model():
    arch = parse_hf_config(*load_hf_config("tiny-qwen3-moe"))
    config = load_config(None, ["parallel.tp=2", "parallel.etp=1"])
    with pytest.raises(ConfigError, match="trains MoE experts wrongly"):
        transformer_config(arch, config, CPU, use_te=False)
    config = load_config(None, ["parallel.tp=8", "parallel.etp=8"])
    with pytest.raises(ConfigError, match="num_attention_heads=4 is not divisible by parallel.tp=8"):
        transformer_config(arch, config, CPU, use_te=False)
    config = load_config(None, ["parallel.pp=2", "model.moe_token_dispatcher=allgather"])
    with pytest.raises(ConfigError, match="allgather cannot run with parallel.pp > 1"):
        transformer_config(arch, config, CPU, use_te=False)


def test_cpu_layer_refuses_a_cuda_machine_mocked(monkeypatch):
    """Mocked CUDA: the CPU layer must never patch a process that can use a GPU."""
    from megatron_rl.runtime.cpu import megatron_patches as cpu_compat

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="device: cpu was chosen on a machine with CUDA"):
        cpu_compat.activate()
    assert not cpu_compat.is_active()


@pytest.mark.subprocess  # a fresh interpreter
def test_moe_router_runs_without_transformer_engine_on_any_device():
    """Megatron-Core 0.16.1's router names `te_general_gemm`, defined only when Transformer Engine
    imports: every MoE forward raised NameError on an H200 without TE (the CPU layer repaired it
    for CPU only). Reproduced without a GPU: Megatron imported with no CPU layer, the router's
    gating GEMM called on CPU tensors, before and after the builder's repair."""
    import subprocess
    import sys

    code = """
import torch
from megatron.core.transformer.moe import moe_utils
assert not hasattr(moe_utils, "te_general_gemm"), "Transformer Engine is installed: nothing to reproduce"
x, w = torch.randn(4, 8), torch.randn(3, 8)
try:
    moe_utils.router_gating_linear(x, w, None, torch.float32)
    print("before: ran")
except NameError as exc:
    print("before: NameError", exc)
from megatron_rl.model.builder import _define_router_gemm_without_te
_define_router_gemm_without_te()
out = moe_utils.router_gating_linear(x, w, None, torch.float32)
print("after:", torch.allclose(out, x @ w.T, atol=1e-6))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "before: NameError" in result.stdout and "after: True" in result.stdout, result.stdout


@pytest.mark.subprocess  # a fresh interpreter: the CPU layer is process-wide
def test_functions_megatron_compiles_run_eagerly_under_the_cpu_layer():
    """Megatron's `jit_fuser` is torch.compile: on CPU every decorated function (the router's
    expert-bias count, the experts' GLU) was built by inductor with the machine's C++ compiler,
    once per new shape (36.1 s -> 25.9 s for the tiny DeepSeek-V3 run without it). Under the CPU
    layer they run as plain Python, before (Megatron decorated them at import) and after it."""
    import subprocess
    import sys

    code = """
import torch
from torch._dynamo.utils import counters
from megatron.core.jit import jit_fuser
from megatron.core.transformer.moe.router import TopKRouter  # decorated at import

@jit_fuser
def count(routing_map, totals):
    seen.append(torch.compiler.is_compiling())
    totals += routing_map.sum(dim=0)
    return totals

from megatron_rl.runtime.cpu import megatron_patches
megatron_patches.activate()
seen, totals = [], torch.zeros(4)
for tokens in (5, 9):
    totals = count(torch.ones(tokens, 4, dtype=torch.bool), totals)
print("compiling:", seen, "frames:", counters["frames"]["total"], "totals:", totals.tolist())
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compiling: [False, False] frames: 0 totals: [14.0, 14.0, 14.0, 14.0]" in result.stdout, result.stdout
