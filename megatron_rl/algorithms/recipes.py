"""Named recipes: advantage estimator, ratio level, aggregation, clipping and shaping as published.

``recipe(name, **overrides)`` returns a ``Recipe`` whose ``loss`` is a ``PolicyLossConfig``
and whose other fields tell the trainer how to compute advantages and which DAPO-style data
steps to run. What each recipe takes from its paper:

``grpo`` -- DeepSeekMath (arXiv:2402.03300) §4.1 / §4.2 training setup:
    std-normalized group advantage, token-level PPO clip eps = 0.2, per-sample token mean then
    mean over samples (``seq-mean-token-mean``), KL in the loss with the k3 estimator and
    beta = 0.04 (the paper's value; it needs ``ref_logprobs``). We keep the paper's beta
    rather than 0 so the recipe is GRPO as published; pass ``kl_coef=0`` for the common
    verifiable-reward practice (DAPO, Dr. GRPO and TRL all drop it).
    The paper does not say which std; we use torch.std (unbiased), as verl and TRL do.
``dr_grpo`` -- Dr. GRPO (arXiv:2503.20783) §3.2: mean-only advantage (r - mean), per-token sum
    divided by the constant L_norm (``seq-mean-token-sum-norm``), eps = 0.2, no KL. L_norm
    defaults to the longest response of the step; pass ``l_norm=<generation budget>`` to use
    the paper's constant max generation length.
``dapo`` -- DAPO (arXiv:2503.14476) §3 / §4.1: std-normalized advantage, clip-higher
    eps_low = 0.2 / eps_high = 0.28, ``token-mean`` over all tokens of the step, no KL, dynamic
    sampling (drop zero-spread groups), overlong reward shaping with L_max = 20480 and
    L_cache = 4096 (the paper's generation budget and a fifth of it; a run's ``rl`` config
    scales them to its own ``max_response_tokens``, ``from_config.recipe_for``). Truncated-
    completion masking (overlong filtering) was DAPO's ablation, not its final recipe:
    ``mask_truncated=False``.
``gspo`` -- GSPO (arXiv:2507.18071) §4.1 / §5.1: sequence-level ratio s_i (length-normalized),
    clip range 3e-4 / 4e-4, per-sample token mean then mean over samples (the GSPO objective
    averages s_i A_i over the group), std-normalized advantage, no KL.
``cispo`` -- MiniMax-M1 (arXiv:2506.13585) §3.1: CISPO loss with the IS weight truncated above
    and no lower bound (eps_low = 1 -> lower bound 0; the paper tunes only eps_high and does
    not publish its value: 0.28, DAPO's clip-higher, is our default; tune it), ``token-mean``
    (the paper normalizes by the total token count), std-normalized advantage, no KL.
``olmo3`` -- Olmo 3's RLVR recipe (OlmoRL; Olmo 3 technical report, arXiv:2512.13961), DAPO
    and Dr. GRPO combined, as the write-up "The Real Problem: Vanilla GRPO Has Three Biases"
    (section "Olmo 3's composite recipe") states it: Dr. GRPO's mean-only advantage (no std),
    DAPO's ``token-mean`` reduction over all tokens of the step, asymmetric clip 0.8 / 1.3
    (eps_low = 0.2 / eps_high = 0.3, "a touch looser on the upper bound than DAPO"), no KL on
    verifiable rewards, and dynamic sampling (zero-spread groups dropped and refilled; the
    report's zero-gradient filtering plus active sampling). The report's OlmoRL also corrects
    the train/inference mismatch with token-level truncated importance sampling against the
    engine's logprobs (Yao et al. 2025; the write-up does not cover it): ``tis_level="token"``,
    truncated at 2.0 (our default cap). Olmo 3's prompt curriculum (success-rate bands) is the
    data sampler's job, not the loss's. The write-up's comparison table also ticks overlong
    shaping for Olmo 3, but its recipe text does not list it: off here (set
    ``overlong_max_length`` to add it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_rl.algorithms.advantages import ADVANTAGE_ESTIMATORS, STD_ESTIMATORS
from megatron_rl.algorithms.config import PolicyLossConfig, resolve_aliases
from megatron_rl.algorithms.names import RECIPE_NAMES

__all__ = ["Recipe", "RECIPES", "recipe"]


@dataclass(frozen=True)
class Recipe:
    """A full algorithm setting: what the trainer does around ``policy_loss`` and the loss config.

    Attributes:
        name: recipe name.
        loss: the ``PolicyLossConfig`` for ``policy_loss``.
        advantage_estimator: for ``compute_advantages(rewards, estimator=...)``.
        advantage_std: std estimator for std-normalized advantages.
        dynamic_sampling: drop groups with zero reward spread and oversample (DAPO §3.2).
        overlong_max_length, overlong_buffer_length, overlong_penalty_factor: DAPO overlong
            reward shaping (None = off), see ``shaping.overlong_penalty``.
        mask_truncated: zero the loss of truncated responses (DAPO overlong filtering).
        paper: the paper (and section) the settings come from.
    """

    name: str
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    advantage_estimator: str = "grpo"
    advantage_std: str = "unbiased"
    dynamic_sampling: bool = False
    overlong_max_length: int | None = None
    overlong_buffer_length: int | None = None
    overlong_penalty_factor: float = 1.0
    mask_truncated: bool = False
    paper: str = ""

    def __post_init__(self):
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"advantage_estimator must be one of {ADVANTAGE_ESTIMATORS}, got {self.advantage_estimator!r}"
            )
        if self.advantage_std not in STD_ESTIMATORS:
            raise ValueError(f"advantage_std must be one of {STD_ESTIMATORS}, got {self.advantage_std!r}")
        if (self.overlong_max_length is None) != (self.overlong_buffer_length is None):
            raise ValueError(
                "overlong_max_length and overlong_buffer_length must be set together, got "
                f"{self.overlong_max_length!r} and {self.overlong_buffer_length!r}"
            )
        if self.overlong_max_length is not None and not 0 < self.overlong_buffer_length <= self.overlong_max_length:
            raise ValueError(
                f"overlong_buffer_length={self.overlong_buffer_length} must be in [1, overlong_max_length="
                f"{self.overlong_max_length}]"
            )


RECIPES: dict[str, Recipe] = {
    "grpo": Recipe(
        name="grpo",
        loss=PolicyLossConfig(eps_low=0.2, eps_high=0.2, loss_agg_mode="seq-mean-token-mean",
                              kl_coef=0.04, kl_loss_type="k3"),
        advantage_estimator="grpo",
        paper="DeepSeekMath, arXiv:2402.03300 §4.1-4.2",
    ),
    "dr_grpo": Recipe(
        name="dr_grpo",
        loss=PolicyLossConfig(eps_low=0.2, eps_high=0.2, loss_agg_mode="seq-mean-token-sum-norm"),
        advantage_estimator="dr_grpo",
        paper="Dr. GRPO, arXiv:2503.20783 §3.2",
    ),
    "dapo": Recipe(
        name="dapo",
        loss=PolicyLossConfig(eps_low=0.2, eps_high=0.28, loss_agg_mode="token-mean"),
        advantage_estimator="grpo",
        dynamic_sampling=True,
        overlong_max_length=20480,
        overlong_buffer_length=4096,
        paper="DAPO, arXiv:2503.14476 §3, §4.1",
    ),
    "gspo": Recipe(
        name="gspo",
        loss=PolicyLossConfig(ratio_level="sequence", eps_low=3e-4, eps_high=4e-4,
                              loss_agg_mode="seq-mean-token-mean"),
        advantage_estimator="grpo",
        paper="GSPO, arXiv:2507.18071 §4.1, §5.1",
    ),
    "olmo3": Recipe(
        name="olmo3",
        loss=PolicyLossConfig(eps_low=0.2, eps_high=0.3, loss_agg_mode="token-mean", kl_coef=0.0,
                              tis_level="token", tis_mode="truncate", tis_upper=2.0),
        advantage_estimator="dr_grpo",
        dynamic_sampling=True,
        paper="Olmo 3 (OlmoRL), arXiv:2512.13961",
    ),
    "cispo": Recipe(
        name="cispo",
        loss=PolicyLossConfig(policy_loss_type="cispo", eps_low=1.0, eps_high=0.28, loss_agg_mode="token-mean"),
        advantage_estimator="grpo",
        paper="MiniMax-M1 (CISPO), arXiv:2506.13585 §3.1",
    ),
}

if set(RECIPES) != set(RECIPE_NAMES):  # names.py declares what a config may name
    raise ImportError(f"recipes {sorted(RECIPES)} differ from the names a config accepts {sorted(RECIPE_NAMES)}")


def recipe(name: str, **overrides) -> Recipe:
    """The named recipe with ``overrides`` applied (validated again).

    Overrides may name ``Recipe`` fields (``advantage_estimator``, ``dynamic_sampling``, ...)
    or ``PolicyLossConfig`` fields / ``from_dict`` aliases (``eps_high``, ``clip_ratio_high``,
    ``kl_coef``, ``l_norm``, ...); anything else is a ValueError. Example:
    ``recipe("dr_grpo", l_norm=8192)``, ``recipe("grpo", kl_coef=0.0)``.
    """
    if name not in RECIPES:
        raise ValueError(f"recipe name must be one of {sorted(RECIPES)}, got {name!r}")
    base = RECIPES[name]
    recipe_fields = {f.name for f in dataclasses.fields(Recipe)} - {"name", "loss"}
    top = {k: v for k, v in overrides.items() if k in recipe_fields}
    loss_overrides = {k: v for k, v in overrides.items() if k not in recipe_fields}
    if "name" in overrides:
        raise ValueError("the recipe name cannot be overridden")
    loss = base.loss
    if loss_overrides:
        loss = dataclasses.replace(loss, **resolve_aliases(loss_overrides))  # validated again
    return dataclasses.replace(base, loss=loss, **top)
