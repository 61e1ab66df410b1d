"""RL post-training algorithms (GRPO family) as pure tensor functions; no Megatron needed.

Public API (kept stable: the trainer and outside checks call it; see docs/algorithms.md):

* advantages: ``compute_advantages(rewards, estimator=..., ...)`` and the individual
  estimators (grpo, dr_grpo, rloo, reinforce_plus_plus_baseline, grpo_process).
* shaping / filtering (DAPO): ``overlong_penalty``, ``apply_overlong_penalty``,
  ``is_truncated``, ``mask_truncated``, ``zero_spread_groups``, ``dynamic_sampling_keep``.
* loss: ``policy_loss(logprobs, old_logprobs, advantages, mask, config, *, normalizer, ...)``
  -> ``(loss, metrics)``, ``PolicyLossConfig``, ``recipe(name, **overrides)``.
* step normalization: ``compute_step_normalizer(masks, ...)`` -> ``StepNormalizer``.
* metrics: ``reduce_metrics(dicts, group=None)``, ``length_bias_metrics(rewards, lengths)``.
* helpers: ``kl_penalty``, ``agg_loss``, ``segments_to_padded``.
"""

from megatron_rl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    STD_ESTIMATORS,
    compute_advantages,
    dr_grpo_advantages,
    grpo_advantages,
    process_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from megatron_rl.algorithms.aggregation import LOSS_AGG_MODES, agg_loss
from megatron_rl.algorithms.config import PolicyLossConfig
from megatron_rl.algorithms.kl import KL_TYPES, kl_penalty
from megatron_rl.algorithms.layout import segments_to_padded
from megatron_rl.algorithms.metrics import length_bias_metrics, reduce_metrics
from megatron_rl.algorithms.normalization import StepNormalizer, compute_step_normalizer
from megatron_rl.algorithms.policy_loss import policy_loss
from megatron_rl.algorithms.recipes import RECIPES, Recipe, recipe
from megatron_rl.algorithms.shaping import (
    apply_overlong_penalty,
    dynamic_sampling_keep,
    is_truncated,
    mask_truncated,
    overlong_penalty,
    zero_spread_groups,
)

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
    "reduce_metrics",
    "length_bias_metrics",
    "kl_penalty",
    "agg_loss",
    "segments_to_padded",
]
