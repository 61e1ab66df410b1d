"""vLLM-CPU kernels chosen for the machine before an engine starts (runtime/cpu/vllm_kernels.py).

- With AMX, MLA in float32 (or with head dims AMX tiles do not fill) is sent to CPU_MLA, which
  takes it; bfloat16 DeepSeek-V3 shapes keep AMX_MLA; without AMX nothing is forced (CPU_MLA is
  vLLM's choice already) and dense models are never touched. The decision is what vLLM reads:
  the flag reaches `vllm serve`'s own argument parser.
- A model no CPU engine can run (MLA with a latent width, or a head size, vLLM-CPU has no kernel
  for) is refused by preflight, naming the keys, before any model is built.
- `megatron-rl train --verbose` prints the CPU's features and the kernels chosen.
- On a machine with AMX, a float32 DeepSeek-V3 engine starts and matches transformers (vLLM's own
  choice, AMX_MLA, dies at start-up there); elsewhere the test says in its name why it is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _support.processes import REPO, child_env, cli_command
from megatron_rl.errors import ConfigError
from megatron_rl.runtime.cpu.vllm_kernels import (
    CpuFeatures,
    cpu_features,
    describe,
    engine_attention_backend,
    refuse_unrunnable,
)

AMX = CpuFeatures(model="Intel Xeon (AMX)", amx_tile=True, avx512=True, avx512_bf16=True)
ZEN3 = CpuFeatures(model="AMD EPYC (Zen 3)", amx_tile=False, avx512=False, avx512_bf16=False)
DEEPSEEK = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
TINY_DEEPSEEK = dict(DEEPSEEK, qk_nope_head_dim=16, v_head_dim=16)  # what the tests' engines run
QWEN3 = dict(hidden_size=64, num_attention_heads=4, head_dim=32)


@pytest.mark.parametrize("raw, dtype, features, expected", [
    (DEEPSEEK, "float32", AMX, "CPU_MLA"),        # AMX_MLA takes bfloat16 only
    (DEEPSEEK, "bfloat16", AMX, None),            # real DeepSeek-V3 heads in bf16: AMX_MLA runs it
    (TINY_DEEPSEEK, "bfloat16", AMX, "CPU_MLA"),  # 16-wide heads: AMX tiles are 32 x 16
    (DEEPSEEK, "float32", ZEN3, None),            # CPU_MLA is vLLM's own choice without AMX
    (QWEN3, "float32", AMX, None),                # no MLA: CPU_ATTN, untouched
], ids=["mla-fp32-amx", "mla-bf16-amx", "mla-bf16-narrow-heads-amx", "mla-fp32-no-amx", "dense-amx"])
def test_attention_backend_follows_what_the_kernels_accept(raw, dtype, features, expected):
    assert engine_attention_backend(raw, dtype, features) == expected
    line = describe(features, raw, dtype)
    assert ("amx yes" if features.amx_tile else "amx no") in line
    if "kv_lora_rank" in raw:
        assert f"attention {expected or ('AMX_MLA' if features.amx_tile else 'CPU_MLA')}" in line


def test_vllm_serve_parses_the_flag_we_pass():
    """`--attention-backend=CPU_MLA` means what we think to vLLM's own argument parser."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from megatron_rl.rollout.engines.vllm_common import cpu_kernel_args

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", "m", "--attention-backend=CPU_MLA"])
    assert str(EngineArgs.from_cli_args(args).attention_backend).upper().endswith("CPU_MLA")


def test_mla_without_a_cpu_kernel_is_refused_before_start(tmp_path):
    with pytest.raises(ConfigError, match=r"kv_lora_rank=32 with qk_rope_head_dim=8: vLLM's CPU engines"):
        refuse_unrunnable(dict(DEEPSEEK, kv_lora_rank=32, qk_rope_head_dim=8), "config.json")
    refuse_unrunnable(DEEPSEEK, "config.json")  # DeepSeek-V3's own geometry runs
    with pytest.raises(ConfigError, match=r"head_dim=24: vLLM's CPU attention kernels"):
        refuse_unrunnable(dict(QWEN3, head_dim=24), "config.json")
    refuse_unrunnable(QWEN3, "config.json")

    from megatron_rl.config import load_config
    from megatron_rl.model.hf_config import load_hf_config
    from megatron_rl.train.preflight import check_layout_and_paths

    raw, _ = load_hf_config("tiny-deepseek-v3")
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, kv_lora_rank=32, qk_rope_head_dim=8)))
    config = load_config(None, ["device=cpu", f"model.hf_config={tmp_path}"])
    with pytest.raises(ConfigError, match="kv_lora_rank=32"):
        check_layout_and_paths(config)


def test_verbose_start_up_line_names_cpu_features_and_kernels(tmp_path):
    """The line comes before any model is built: a run whose data file is missing still shows it."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(
        cli_command("train", "--verbose", "model.hf_config=tiny-deepseek-v3", f"output_dir={tmp_path / 'run'}",
                    f"data.train={tmp_path / 'missing.jsonl'}"),
        env=env, capture_output=True, text=True, timeout=300)
    line = next((l for l in result.stdout.splitlines() if l.startswith("megatron-rl: cpu: ")), None)
    assert line, result.stdout[-2000:] + result.stderr[-2000:]
    features = cpu_features()
    assert f"amx {'yes' if features.amx_tile else 'no'}" in line and "vLLM kernels: " in line
    # float32 MLA: CPU_MLA here whatever the CPU (vLLM's choice without AMX, ours with it).
    assert "attention CPU_MLA" in line and "linear oneDNN (float32)" in line


AMX_HERE = cpu_features().amx_tile


@pytest.mark.engine
@pytest.mark.skipif(not AMX_HERE, reason="needs a CPU with Intel AMX tiles (amx_tile), where vLLM-CPU loads its AMX kernels; this one has none")
def test_on_amx_cpus_an_fp32_mla_engine_starts_and_matches_transformers(tmp_path):
    """Runs the DeepSeek-V3 engine check (tests/rollout/families_worker.py) on this AMX machine."""
    worker = REPO / "tests" / "rollout" / "families_worker.py"
    out = tmp_path / "report.json"
    env = child_env(OMP_NUM_THREADS="2")
    result = subprocess.run([sys.executable, str(worker), "--family", "deepseek_v3", "--root", str(tmp_path),
                             "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]
    report = json.loads(out.read_text())
    assert max(report["initial"]["prefill"], report["initial"]["decode"]) <= 1e-4, report
