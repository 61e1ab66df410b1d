"""The longest context a rollout engine serves a config.json's model with, derived as vLLM derives
it, so that preflight can refuse a longer rollout.max_model_len by name before any engine starts
(vLLM's own refusal is a pydantic traceback on every rank, after the warm start)."""

from __future__ import annotations

import math
from typing import Any

from megatron_rl.model.hf_config import FAMILIES, _rope_parameters

# The keys a rollout engine reads a model's context from, as vLLM does (derive_max_model_len_and_key
# in vllm/transformers_utils/model_arch_config_convertor.py): the smallest one present, except that
# model_max_length, when present, is taken as it is.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
# What transformers' config class of each family fills in when config.json has none of them: the
# engines load config.json through it.
CONTEXT_DEFAULTS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768, "qwen3_moe": 32768, "mixtral": 4096 * 32,
                    "deepseek_v3": 4096, "glm4_moe": 131072}
# RoPE scalings whose max_position_embeddings is the scaled context already (YaRN: DeepSeek-V3's
# 163840 = 4096 x factor 40); vLLM multiplies the context of the others by their `factor`.
ROPE_SCALED_ALREADY = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def engine_context(raw: dict[str, Any]) -> tuple[int, str]:
    """(the longest context, in tokens, a rollout engine serves this config.json's model with,
    the key it comes from): what vLLM derives and refuses a longer max_model_len against (its
    pydantic check, at engine start). The key is `family default` when config.json names none."""
    present = {key: raw[key] for key in CONTEXT_KEYS
               if isinstance(raw.get(key), int) and not isinstance(raw.get(key), bool) and raw[key] > 0}
    if "model_max_length" in present:
        key = "model_max_length"
    elif present:
        key = min(present, key=lambda name: present[name])
    else:
        architectures = raw.get("architectures") or [None]
        family = FAMILIES.get(architectures[0]) if isinstance(architectures, list) else None
        context = CONTEXT_DEFAULTS.get(family.name, 2048) if family is not None else 2048
        return context, "family default"
    context = present[key]
    params = _rope_parameters(raw)
    rope_type = params.get("rope_type", params.get("type")) if isinstance(params, dict) else None
    factor = params.get("factor") if isinstance(params, dict) else None
    if (rope_type not in (None, *ROPE_SCALED_ALREADY) and isinstance(factor, (int, float))
            and not isinstance(factor, bool) and math.isfinite(factor) and factor > 0):
        return int(context * factor), f"{key} x rope factor {factor:g}"
    return context, key
