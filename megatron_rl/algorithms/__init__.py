"""RL post-training algorithms (GRPO family) as pure tensor functions; no Megatron needed.

Public API (kept stable: the trainer and outside checks call it; see docs/algorithms.md):

* advantages: ``compute_advantages(rewards, estimator=..., ...)`` and the individual
  estimators (grpo, dr_grpo, rloo, reinforce_plus_plus_baseline, grpo_process).
* shaping / filtering (DAPO): ``overlong_penalty``, ``apply_overlong_penalty``,
  ``is_truncated``, ``mask_truncated``, ``zero_spread_groups``, ``dynamic_sampling_keep``.
* loss: ``policy_loss(logprobs, old_logprobs, advantages, mask, config, *, normalizer, ...)``
  -> ``(loss, metrics)``, ``PolicyLossConfig``, ``recipe(name, **overrides)``.
* step normalization: ``compute_step_normalizer(masks, ...)`` -> ``StepNormalizer``; with
  off-policy masks, of ``off_policy_keep(mask, config, ...)`` (masked tokens leave it).
* metrics: ``reduce_metrics(dicts, group=None)``, ``length_bias_metrics(rewards, lengths)``.
* on-policy distillation (``distill.py``): ``distillation_advantages`` (the teacher's per-token
  reverse-KL signal mixed with the reward's advantage), ``distillation_metrics``.
* helpers: ``kl_penalty``, ``agg_loss``, ``segments_to_padded``.
* names (``names.py``, no torch): every algorithm name a config may write, declared once;
  ``from_config.recipe_for(rl, response_budget)``: the recipe a run's ``rl`` section selects.

The names below load on first use (PEP 562), so that the config can import ``names`` and
``from_config`` without importing torch.
"""

import importlib

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "STD_ESTIMATORS",
    "LOSS_AGG_MODES",
    "KL_TYPES",
    "RECIPES",
    "compute_advantages",
    "grpo_advantages",
    "dr_grpo_advantages",
    "rloo_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "process_advantages",
    "overlong_penalty",
    "apply_overlong_penalty",
    "is_truncated",
    "mask_truncated",
    "zero_spread_groups",
    "dynamic_sampling_keep",
    "PolicyLossConfig",
    "policy_loss",
    "Recipe",
    "recipe",
    "StepNormalizer",
    "compute_step_normalizer",
    "off_policy_keep",
    "reduce_metrics",
    "length_bias_metrics",
    "kl_penalty",
    "agg_loss",
    "segments_to_padded",
    "distillation_advantages",
    "distillation_metrics",
]

_MODULE_OF = {
    "ADVANTAGE_ESTIMATORS": "advantages",
    "STD_ESTIMATORS": "advantages",
    "compute_advantages": "advantages",
    "dr_grpo_advantages": "advantages",
    "grpo_advantages": "advantages",
    "process_advantages": "advantages",
    "reinforce_plus_plus_baseline_advantages": "advantages",
    "rloo_advantages": "advantages",
    "LOSS_AGG_MODES": "aggregation",
    "agg_loss": "aggregation",
    "PolicyLossConfig": "config",
    "KL_TYPES": "kl",
    "kl_penalty": "kl",
    "segments_to_padded": "layout",
    "length_bias_metrics": "metrics",
    "reduce_metrics": "metrics",
    "StepNormalizer": "normalization",
    "compute_step_normalizer": "normalization",
    "off_policy_keep": "offpolicy",
    "policy_loss": "loss",
    "RECIPES": "recipes",
    "Recipe": "recipes",
    "recipe": "recipes",
    "apply_overlong_penalty": "shaping",
    "dynamic_sampling_keep": "shaping",
    "is_truncated": "shaping",
    "mask_truncated": "shaping",
    "overlong_penalty": "shaping",
    "zero_spread_groups": "shaping",
    "distillation_advantages": "distill",
    "distillation_metrics": "distill",
}


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'megatron_rl.algorithms' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"megatron_rl.algorithms.{_MODULE_OF[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
