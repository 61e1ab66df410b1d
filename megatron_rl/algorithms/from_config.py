"""The recipe a run's `rl` config section selects: the named recipe with the section's overrides,
and the defaults that follow from the run (overlong shaping at the run's response budget, token
TIS for asynchronous runs, Dr. GRPO's L_norm = the generation budget), and rl.off_policy's
corrections as loss fields.

No torch at import: the config calls `overlong_lengths` while it validates, before torch is
imported; `recipe_for` builds the Recipe (which imports torch) when the trainer asks for it.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.errors import ConfigError

# The `rl` fields that override the recipe's value when set (not None), under the same name.
OVERRIDABLE = ("kl_coef", "entropy_coef", "eps_low", "eps_high", "dynamic_sampling", "dual_clip_c",
               "advantage_estimator", "loss_agg_mode", "ratio_level", "overlong_penalty_factor", "mask_truncated",
               "tis_mode", "tis_upper", "tis_lower")


def overlong_lengths(rl, recipe_max: int | None, recipe_buffer: int | None, where: str = "rl",
                     budget: int | None = None) -> dict[str, Any]:
    """The overlong-shaping overrides for `rl` (an RLConfig; see its overlong_* field comments)
    on top of a recipe whose own lengths are `recipe_max` / `recipe_buffer` (None: it does not
    shape). `budget`: the most model tokens one trajectory holds (RunConfig.response_budget;
    None: rl.max_response_tokens, a single-turn run's). Shaping measures a trajectory's model
    tokens, so its default length is this budget: a multi-turn trajectory's turns together, not
    one turn's cap (against which every tool-calling trajectory would be shaped as overlong).
    Raises ConfigError for lengths that could never apply."""
    if budget is None:
        budget = rl.max_response_tokens
    if rl.overlong_penalty_factor == 0:
        return {"overlong_max_length": None, "overlong_buffer_length": None}
    lengths = (recipe_max, rl.overlong_max_length, rl.overlong_buffer_length)
    if all(value is None for value in lengths):
        return {}
    # DAPO's buffer is a fifth of its budget (4096 / 20480); a recipe's own ratio if it has one.
    num, den = (recipe_buffer, recipe_max) if recipe_max is not None else (1, 5)
    length = rl.overlong_max_length if rl.overlong_max_length is not None else budget
    buffer = rl.overlong_buffer_length
    if buffer is None:
        buffer = max(1, (num * length + den // 2) // den)  # rounded half up, in integers
    if buffer > length:
        raise ConfigError(f"{where}.overlong_buffer_length={buffer} must be <= overlong_max_length={length}")
    if length - buffer >= budget:
        what = (f"max_response_tokens={budget}" if budget == rl.max_response_tokens else
                f"the {budget} model tokens a trajectory can hold (rollout.max_turns x rl.max_response_tokens, at most "
                f"rollout.max_total_tokens)")
        raise ConfigError(
            f"{where}: overlong shaping would never apply: its soft budget overlong_max_length - "
            f"overlong_buffer_length = {length} - {buffer} = {length - buffer} is not below "
            f"{what}; lower overlong_max_length (null = the budget) or set overlong_penalty_factor: 0 for no shaping")
    return {"overlong_max_length": length, "overlong_buffer_length": buffer}


# rl.off_policy.high when null, per method: TIS's cap (Yao et al.), IcePop's band [0.5, 5] (Ring-1T).
_DEFAULT_HIGH = {"tis": 2.0, "icepop": 5.0, "mis": 2.0}


def off_policy_overrides(off) -> dict[str, Any]:
    """The PolicyLossConfig fields that rl.off_policy (an OffPolicyConfig with a method) selects:
    tis -> truncate, icepop -> a token-level mask with both bounds, mis -> a mask at its level."""
    if off.method == "off":
        return {"tis_level": None}
    level = "token" if off.method == "icepop" else (off.level or "token")
    lower = off.low if off.low is not None else (0.5 if off.method == "icepop" else None)
    upper = off.high if off.high is not None else _DEFAULT_HIGH[off.method]
    return {"tis_level": level, "tis_mode": "truncate" if off.method == "tis" else "mask", "tis_upper": upper,
            "tis_lower": lower}


def recipe_for(rl, response_budget: int | None = None):
    """The Recipe (megatron_rl.algorithms.Recipe) that `rl` (an RLConfig) selects, for
    trajectories of at most `response_budget` model tokens (RunConfig.response_budget; None:
    rl.max_response_tokens, a single-turn run's).

    Raises ConfigError for overlong lengths that cannot apply; the recipe's own checks raise
    ValueError (the trainer's preflight reports them as ConfigError)."""
    from megatron_rl.algorithms.recipes import RECIPES, recipe  # imports torch: only when a run builds it

    base = RECIPES[rl.recipe]
    overrides = {name: getattr(rl, name) for name in OVERRIDABLE if getattr(rl, name) is not None}
    if getattr(rl, "teacher", None) is not None and rl.dynamic_sampling is None:
        # With a teacher every token carries a signal: a group whose rewards are all equal (the
        # whole group under distillation alone) is not empty of it, so the recipe's dynamic
        # sampling would drop what the teacher teaches. rl.dynamic_sampling: true still applies.
        overrides["dynamic_sampling"] = False
    budget = rl.max_response_tokens if response_budget is None else response_budget
    overrides.update(overlong_lengths(rl, base.overlong_max_length, base.overlong_buffer_length, budget=budget))
    if rl.off_policy.method is not None:
        overrides.update(off_policy_overrides(rl.off_policy))
    elif rl.tis_level == "off":
        overrides["tis_level"] = None
    elif rl.tis_level is not None:
        overrides["tis_level"] = rl.tis_level
    elif base.loss.tis_level is None and (rl.tis_upper is not None or rl.max_staleness >= 1):
        # tis_upper alone turns token-level TIS on; so does an asynchronous run (AReaL's
        # decoupled objective: the behaviour weight pi_prox / pi_behav, truncated).
        overrides["tis_level"] = "token"
    if rl.off_policy.opsm_delta is not None:
        overrides["opsm_delta"] = rl.off_policy.opsm_delta
    tis_on = overrides.get("tis_level", base.loss.tis_level) is not None
    if not tis_on and (rl.tis_mode is not None or rl.tis_lower is not None):
        name = "tis_mode" if rl.tis_mode is not None else "tis_lower"
        raise ConfigError(f"{name} has no effect: TIS is off (recipe {rl.recipe} has none); set tis_level or "
                          f"tis_upper")
    chosen = recipe(rl.recipe, **overrides)
    if chosen.loss.loss_agg_mode == "seq-mean-token-sum-norm" and chosen.loss.l_norm is None:
        # Dr. GRPO divides by a constant: the generation budget, as in the paper.
        chosen = recipe(rl.recipe, **overrides, l_norm=budget)
    return chosen
