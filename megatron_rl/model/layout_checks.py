"""Does a parallel layout fit a model? Pure arithmetic on the HF config, no torch or Megatron
import, so a bad layout is refused in milliseconds, before any process group or model exists."""

from __future__ import annotations

from megatron_rl.errors import ConfigError
from megatron_rl.model.hf_config import ArchitectureSpec


def check_layout(config, arch, world: int, *, rl: bool = True, source: str = "the model") -> None:
    """The parallel layout against the model and the world size, with no file or machine read:
    what `megatron-rl plan` calls a layout preflight accepts."""
    config.parallel.validate_for_model("parallel", num_experts=arch.num_experts if arch.is_moe else None)
    check_divisibility(arch, config)
    if rl and config.rl.routing_replay == "rollout" and not arch.is_moe:
        raise ConfigError(f"rl.routing_replay=rollout replays the rollout engine's MoE routes, but "
                          f"{source} is a dense model (no experts); use rl.routing_replay=off")
    config.parallel.validate_world_size(world)
    if rl and config.rollout.mode == "colocated" and arch.num_key_value_heads % world:
        raise ConfigError(
            f"rollout.mode=colocated shards the engine over all {world} ranks, which must divide the "
            f"model's {arch.num_key_value_heads} KV heads; use rollout.mode=server"
        )


def check_divisibility(arch: ArchitectureSpec, config) -> None:
    """`config`: the RunConfig (its `parallel` section, and the model keys that need a model feature)."""
    p = config.parallel
    checks = [
        ("num_attention_heads", arch.num_attention_heads, "tp", p.tp),
        ("num_key_value_heads", arch.num_key_value_heads, "tp", p.tp),
        ("intermediate_size", arch.ffn_hidden_size, "tp", p.tp),
    ]
    if arch.moe_shared_ffn_hidden_size:
        checks.append(("n_shared_experts*moe_intermediate_size", arch.moe_shared_ffn_hidden_size, "tp", p.tp))
    if arch.mla is not None:
        # Megatron-Core's MLA splits the latent down-projections over TP too.
        checks.append(("kv_lora_rank+qk_rope_head_dim", arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim, "tp", p.tp))
        if arch.mla.q_lora_rank is not None:
            checks.append(("q_lora_rank", arch.mla.q_lora_rank, "tp", p.tp))
    if arch.is_moe:
        checks.append(("moe_intermediate_size", arch.moe_ffn_hidden_size, "etp", p.expert_tp))
    for key, value, axis, size in checks:
        if value % size:
            raise ConfigError(
                f"model {key}={value} is not divisible by parallel.{axis}={size}; choose a layout that divides it"
            )
    check_pipeline_stages(arch.num_layers, p)
    if config.model.lora is not None:
        lora_targets(config.model.lora, arch)
    if config.model.moe_router_bias_update_rate > 0 and not arch.moe_expert_bias:
        raise ConfigError(
            f"model.moe_router_bias_update_rate={config.model.moe_router_bias_update_rate} needs a router with an "
            f"expert bias (e_score_correction_bias: DeepSeek-V3, GLM-4.5); {arch.architecture} has none, "
            "so leave it at 0 (or use model.moe_aux_loss_coeff for load balancing)"
        )


def check_pipeline_stages(num_layers: int, p) -> None:
    """The layers split over pp stages: evenly, or with the first/last stage sizes given."""
    first, last = p.pp_first_stage_layers, p.pp_last_stage_layers
    if first is None and last is None:
        if num_layers % p.pp:
            raise ConfigError(
                f"model num_hidden_layers={num_layers} is not divisible by parallel.pp={p.pp}; choose a pp that "
                "divides it, or set parallel.pp_first_stage_layers / pp_last_stage_layers for uneven stages"
            )
        return
    middle_layers = num_layers - (first or 0) - (last or 0)
    middle_stages = p.pp - (first is not None) - (last is not None)
    if middle_layers < 0 or (middle_stages == 0 and middle_layers) or (middle_stages and (
            middle_layers % middle_stages or middle_layers == 0)):
        raise ConfigError(
            f"parallel.pp_first_stage_layers={first}, pp_last_stage_layers={last} with pp={p.pp} do not split the "
            f"model's {num_layers} layers: the {max(middle_stages, 0)} other stage(s) must share the remaining "
            f"{middle_layers} evenly (at least one each)"
        )


def family_lora_targets(arch: ArchitectureSpec) -> list[str]:
    """The LoRA targets (config/model.py: LoraConfig.targets) this model has."""
    has_dense_mlp = not arch.is_moe or not all(arch.moe_layer_pattern) or bool(arch.moe_shared_ffn_hidden_size)
    present = {
        # Multi-latent attention: its query and key/value projections (down and up, or q_proj).
        "qkv": True,
        "proj": True,
        "fc1": has_dense_mlp,
        "fc2": has_dense_mlp,
        "experts": arch.is_moe,
        "router": arch.is_moe,
    }
    return [target for target, there in present.items() if there]


def lora_targets(lora, arch: ArchitectureSpec) -> list[str]:
    """The targets to adapt: the configured ones, each checked against the model, or (targets
    null) every one the model has except the router."""
    present = family_lora_targets(arch)
    if lora.targets is None:
        return [t for t in present if t != "router"]
    for target in lora.targets:
        if target not in present:
            why = {"experts": "it is a dense model (no experts)", "router": "it is a dense model (no router)",
                   }.get(target, "every MLP layer is MoE without shared experts (no dense fc1/fc2)")
            raise ConfigError(f"model.lora.targets: {arch.architecture} has no {target!r} ({why}); "
                              f"its targets are {', '.join(present)}")
    return list(lora.targets)
