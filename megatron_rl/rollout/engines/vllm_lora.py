"""An adapter-only weight push to vLLM (`rollout.lora_push: adapters`): what it takes and refuses.

A LoRA run (model.lora) by default pushes the merged weights W + (alpha / rank) B A every step.
With `adapters` the colocated engine runs vLLM's own LoRA (`enable_lora`): the frozen base
weights are pushed once, through the ordinary transport with the adapters left out, and every
later push sends only the adapters (PEFT's names, bridge/peft_export.py), which the engine's
workers load from memory under a fresh adapter id (rollout/worker/lora_adapters.py); every
request then carries that adapter. vLLM applies the scale alpha / rank itself (PEFT's
lora_alpha / r), so the pushed B is the trained B.

Refused by name (measured on vLLM's CPU build 0.32, docs/lora.md):
- `experts` and `router`: vLLM's CPU MoE kernel takes no LoRA ("CPUUnquantizedExperts does not
  support LoRA"), and its GPU expert LoRA is untested here; `router` has no vLLM LoRA layer.
- `fc1` / `fc2` of a MoE family (its dense layers or shared experts): PEFT gives them the
  experts' module names (bridge/peft_export.py refuses them too), so vLLM could not tell them apart.
- a family not verified against the trainer (below); anything but the colocated vLLM engine
  (config/run.py).
- an adapter on a module outside the engine's LoRA targets: vLLM would drop it without a word
  (measured: logprobs 0.85 off) and serve the base there, so it is refused before it is pushed
  (`check_engine_targets`), and the workers check again what they were given.

The engine's targets are named explicitly and never include lm_head: with lm_head wrapped, any
request with prompt_logprobs crashes vLLM's CPU engine (punica_cpu einsum broadcast error).

This module imports no torch or vLLM: preflight runs its checks before anything is started.
"""

from __future__ import annotations

from megatron_rl.errors import ConfigError

# The run's targets (config/model.py LORA_TARGETS) -> vLLM's fused module names.
VLLM_MODULES = {"qkv": "qkv_proj", "proj": "o_proj", "fc1": "gate_up_proj", "fc2": "down_proj"}
# PEFT's per-projection modules (bridge/peft_export.py) -> the vLLM module that packs them.
PEFT_TO_VLLM = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
                "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
# Families whose adapter push was checked against the trainer (engine logprobs = trainer's).
VERIFIED_FAMILIES = ("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM")
# vLLM's allowed max_lora_rank values (vllm/config/lora.py MaxLoRARanks).
VLLM_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ADAPTER_NAME = "policy"  # + the adapter id: a fresh name per push keeps no stale prefix cache


def check_adapter_push(config, arch) -> list[str]:
    """The run's LoRA targets, refused by name when vLLM's native LoRA cannot serve them here."""
    from megatron_rl.model.layout_checks import lora_targets

    key = "rollout.lora_push=adapters"
    targets = lora_targets(config.model.lora, arch)
    if arch.architecture not in VERIFIED_FAMILIES:
        raise ConfigError(f"{key}: {arch.architecture} is not a family whose adapter push was verified against the "
                          f"trainer (verified: {', '.join(VERIFIED_FAMILIES)}); use rollout.lora_push=merged")
    moe = [t for t in targets if t in ("experts", "router")]
    if moe:
        raise ConfigError(f"{key} with model.lora.targets {moe}: vLLM's CPU MoE kernel takes no LoRA "
                          "(CPUUnquantizedExperts does not support LoRA), its GPU expert LoRA is untested here, and "
                          "the router has no vLLM LoRA layer; set model.lora.targets to [qkv, proj] or use "
                          "rollout.lora_push=merged")
    dense_mlp = [t for t in targets if t in ("fc1", "fc2")]
    if dense_mlp and arch.is_moe:
        raise ConfigError(f"{key} with model.lora.targets {dense_mlp} on {arch.architecture}: the dense MLPs and "
                          "shared experts of a MoE family share the experts' module names (gate_proj, up_proj, "
                          "down_proj), so vLLM could not tell their adapters apart; use targets [qkv, proj] or "
                          "rollout.lora_push=merged")
    max_rank(config.model.lora.rank)
    return targets


def max_rank(rank: int) -> int:
    """vLLM's max_lora_rank for adapters of `rank`: the smallest value it accepts that holds them."""
    for allowed in VLLM_MAX_RANKS:
        if allowed >= rank:
            return allowed
    raise ConfigError(f"rollout.lora_push=adapters with model.lora.rank={rank}: vLLM serves LoRA ranks up to "
                      f"{VLLM_MAX_RANKS[-1]}; use rollout.lora_push=merged")


def engine_lora_args(targets: list[str], rank: int) -> dict:
    """`vllm.LLM` arguments for the run's adapters: one adapter active, explicit target modules
    (never lm_head), and a CPU cache that holds the old and the new adapter during a swap (vLLM
    would reload an evicted one from its path, which an in-memory adapter does not have)."""
    return {"enable_lora": True, "max_lora_rank": max_rank(rank), "max_loras": 1, "max_cpu_loras": 2,
            "lora_target_modules": sorted({VLLM_MODULES[t] for t in targets})}


def adapter_config(tensors: dict, rank: int, alpha: float) -> dict:
    """PEFT's adapter_config for vLLM's PEFTHelper: its scale lora_alpha / r is the run's alpha / rank."""
    from megatron_rl.bridge.peft_export import adapter_config as peft_config

    return peft_config(tensors, rank, alpha, 0.0, None)


def check_engine_targets(names, engine_modules: list[str]) -> None:
    """Refuse PEFT tensors (names) for a module the engine does not adapt: vLLM would drop them
    silently and serve the base weights there."""
    outside = sorted({name.rsplit(".", 3)[-3] for name in names
                      if PEFT_TO_VLLM.get(name.rsplit(".", 3)[-3]) not in engine_modules})
    if outside:
        raise ConfigError(f"adapter push: adapters on {outside} are outside the engine's LoRA targets {engine_modules}; "
                          "vLLM would drop them without an error and serve the base weights there")
