"""The MoE throughput levers (config/model.py, each off until measured): checked against the
machine, the layer spec, the model and the run before the model is built, then handed to
Megatron-Core and Transformer Engine.

    check_levers(config, arch, hardware, use_te=..., grouped_gemm=...)   # ConfigError, or nothing
    TransformerConfig(..., **transformer_config_fields(config.model, arch))
    select_grouped_gemm_backend(config.model, grouped_gemm=..., environ=os.environ)  # before any forward

Where each refusal comes from (Megatron-Core 0.16.1, Transformer Engine 2.11):
- gradient_accumulation_fusion is TE's fuse_wgrad_accumulation on every TE linear; Megatron-Core's
  own ColumnParallelLinear (the output layer, with the TE spec too) raises at construction unless
  APEX's fused_weight_gradient_mlp_cuda imports (tensor_parallel/layers.py).
- moe_grouped_gemm_backend=cutlass: TE's nvte_multi_tensor_gemm reads NVTE_USE_CUTLASS_GROUPED_GEMM
  at every call and uses CUTLASS only on SM 9.0 with same-dtype BF16/FP16 operands, no epilogue and a
  uniform K % 128 == 0 (else cuBLAS, with a warning only under NVTE_CUTLASS_GROUPED_GEMM_WARN_FALLBACK).
- moe_router_fusion: TE's fused_topk_with_score_function (Megatron imports it from TE 2.7.0.dev) returns before
  the router's RouterReplay is consulted (moe_utils.topk_routing_with_score_function).
- moe_router_padding_for_fp8: Megatron-Core's alias of moe_router_padding_for_quantization.
"""

from __future__ import annotations

import os
from typing import MutableMapping

from megatron_rl.config import ModelConfig, RunConfig
from megatron_rl.config.model import LEVERS_OFF
from megatron_rl.errors import ConfigError
from megatron_rl.model.fp8 import older_version

ROUTER_FUSION_MIN_TE = "2.7.0.dev0"  # Megatron-Core imports TE's fused router kernels from 2.7.0.dev on
CUTLASS_CAPABILITY = (9, 0)  # TE 2.11: `sm_arch(device) == 90`, nothing else
CUTLASS_K_MULTIPLE = 128
CUTLASS_ENV = "NVTE_USE_CUTLASS_GROUPED_GEMM"
CUTLASS_WARN_ENV = "NVTE_CUTLASS_GROUPED_GEMM_WARN_FALLBACK"


def levers_on(model: ModelConfig) -> list[str]:
    """The levers set away from their defaults, by key name."""
    return [name for name, off in LEVERS_OFF.items() if getattr(model, name) != off]


def check_levers(config: RunConfig, arch, hardware, *, use_te: bool, grouped_gemm: bool) -> None:
    """Every lever against this machine, layer spec, model and run (moe_permute_fusion's own check
    stays in the builder). `hardware`: model.fp8.Hardware."""
    model = config.model
    te_levers = [name for name in levers_on(model) if name != "moe_permute_fusion"]
    if te_levers and not use_te:
        where = "CPU" if hardware.device_type != "cuda" else "the local layer spec"
        raise ConfigError(
            f"model.{te_levers[0]}={_shown(getattr(model, te_levers[0]))} is a Transformer Engine lever (CUDA and the "
            f"transformer-engine package, the TE layer spec); this run builds {where}: leave it at its default")
    if model.gradient_accumulation_fusion and not hardware.wgrad_accumulation_kernel:
        raise ConfigError(
            "model.gradient_accumulation_fusion=true needs APEX's fused_weight_gradient_mlp_cuda extension: "
            "Megatron-Core's own output layer takes the same flag and refuses to build without it. Install NVIDIA "
            "apex with its CUDA extensions, or leave gradient_accumulation_fusion false")
    if model.moe_grouped_gemm_backend == "cutlass":
        _check_cutlass(config, arch, hardware, grouped_gemm)
    if model.moe_router_fusion:
        _check_router_fusion(config, arch, hardware)
    if model.moe_router_padding_for_fp8 and not arch.is_moe:
        raise ConfigError("model.moe_router_padding_for_fp8=true applies to MoE routers; this model is dense: leave "
                          "it false")


def _check_cutlass(config: RunConfig, arch, hardware, grouped_gemm: bool) -> None:
    if not grouped_gemm:
        raise ConfigError("model.moe_grouped_gemm_backend=cutlass chooses the grouped-GEMM experts' kernel; this "
                          "model has no grouped-GEMM experts (dense, or model.moe_grouped_gemm: false): use cublas")
    if hardware.capability != CUTLASS_CAPABILITY:
        raise ConfigError(
            f"model.moe_grouped_gemm_backend=cutlass runs only on compute capability 9.0 (Hopper) in Transformer "
            f"Engine; {hardware.describe()} would use cuBLAS without a word: use cublas")
    etp = config.parallel.expert_tp
    for what, k in (("hidden_size", arch.hidden_size),
                    (f"moe_intermediate_size/etp (etp={etp})", arch.moe_ffn_hidden_size // etp)):
        if k % CUTLASS_K_MULTIPLE:
            raise ConfigError(
                f"model.moe_grouped_gemm_backend=cutlass: Transformer Engine's CUTLASS grouped GEMM needs K % "
                f"{CUTLASS_K_MULTIPLE} == 0, but {what} = {k}, so half the expert forward and dgrad GEMMs would fall "
                "back to cuBLAS: use cublas for this model")


def _check_router_fusion(config: RunConfig, arch, hardware) -> None:
    if not arch.is_moe:
        raise ConfigError("model.moe_router_fusion=true fuses the MoE router; this model is dense: leave it false")
    if older_version(hardware.te_version, ROUTER_FUSION_MIN_TE):
        raise ConfigError(f"model.moe_router_fusion=true needs transformer-engine >= {ROUTER_FUSION_MIN_TE} "
                          f"(installed: {hardware.te_version}); upgrade it or leave it false")
    if arch.moe_group_topk:
        raise ConfigError(
            f"model.moe_router_fusion=true: this model routes by expert groups (topk_group={arch.moe_group_topk}), "
            "chosen here by DeepSeek's rule through the router's replay hook, which the fused kernel skips: leave "
            "it false")
    rl = config.rl
    if rl.routing_replay != "off":
        raise ConfigError(
            f"model.moe_router_fusion=true with rl.routing_replay={rl.routing_replay}: the fused router kernel never "
            "consults the recorded routes, so nothing would be replayed; use one or the other")
    if rl.updates_per_rollout > 1 or _masks_tokens(config):
        why = (f"rl.updates_per_rollout={rl.updates_per_rollout}" if rl.updates_per_rollout > 1
               else "an off-policy mask (rl.off_policy)")
        raise ConfigError(
            f"model.moe_router_fusion=true with {why}: the old-logprob pass records each router's choice for "
            "moe/routing_drift through the hook the fused kernel skips; leave moe_router_fusion false")


def _masks_tokens(config: RunConfig) -> bool:
    """Whether this run's loss masks tokens off-policy (then an old-logprob pass runs: train/update.py)."""
    from megatron_rl.algorithms.from_config import recipe_for

    return recipe_for(config.rl, config.response_budget).loss.masks_tokens


def transformer_config_fields(model: ModelConfig, arch) -> dict:
    """The TransformerConfig fields the levers set (after check_levers)."""
    fields = dict(gradient_accumulation_fusion=model.gradient_accumulation_fusion)
    if arch.is_moe:
        fields.update(moe_router_fusion=model.moe_router_fusion,
                      moe_router_padding_for_fp8=model.moe_router_padding_for_fp8)
    return fields


def select_grouped_gemm_backend(model: ModelConfig, *, grouped_gemm: bool,
                                environ: MutableMapping[str, str] = os.environ) -> None:
    """TE reads the backend from the environment at every grouped GEMM (std::getenv in
    nvte_multi_tensor_gemm, nothing cached): set it from the key before the model's first forward,
    so that the key, not an inherited variable, decides. TE parses the value as a number ("true"
    would fail its check), hence "1" / "0"."""
    if not grouped_gemm:
        return
    cutlass = model.moe_grouped_gemm_backend == "cutlass"
    environ[CUTLASS_ENV] = "1" if cutlass else "0"
    if cutlass:
        environ[CUTLASS_WARN_ENV] = "1"  # each fallback to cuBLAS (every wgrad) is logged


def _shown(value) -> str:
    """A value as the config file spells it."""
    return str(value).lower() if isinstance(value, bool) else str(value)
