"""Does a parallel layout fit a model? Pure arithmetic on the HF config, no torch or Megatron
import, so a bad layout is refused in milliseconds, before any process group or model exists."""

from __future__ import annotations

from megatron_rl.errors import ConfigError
from megatron_rl.model.hf_config import ArchitectureSpec


def check_divisibility(arch: ArchitectureSpec, config) -> None:
    """`config`: the RunConfig (its `parallel` section)."""
    p = config.parallel
    checks = [
        ("num_attention_heads", arch.num_attention_heads, "tp", p.tp),
        ("num_key_value_heads", arch.num_key_value_heads, "tp", p.tp),
        ("num_hidden_layers", arch.num_layers, "pp", p.pp),
        ("intermediate_size", arch.ffn_hidden_size, "tp", p.tp),
    ]
    if arch.is_moe:
        checks.append(("moe_intermediate_size", arch.moe_ffn_hidden_size, "etp", p.expert_tp))
    for key, value, axis, size in checks:
        if value % size:
            raise ConfigError(
                f"model {key}={value} is not divisible by parallel.{axis}={size}; choose a layout that divides it"
            )
