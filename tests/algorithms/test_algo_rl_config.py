"""Every algorithm knob of the `rl` config section reaches the recipe (algorithms.from_config.recipe_for), with
errors naming the key; DAPO's overlong lengths follow the run's budget; the olmo3 recipe; the
zero-spread group fraction of the rollout metrics."""

from __future__ import annotations

import typing

import pytest

from megatron_rl.config import rl as config_module
from megatron_rl.algorithms import ADVANTAGE_ESTIMATORS, LOSS_AGG_MODES, RECIPES
from megatron_rl.algorithms.config import RATIO_LEVELS, TIS_LEVELS, TIS_MODES
from megatron_rl.algorithms.from_config import recipe_for
from megatron_rl.config import RLConfig, load_config
from megatron_rl.errors import ConfigError
from megatron_rl.train.experience import Trajectory, rollout_metrics


def algorithm(*overrides: str):
    return recipe_for(load_config(None, [f"rl.{item}" for item in overrides]).rl)


def test_config_choices_are_the_librarys():
    args = typing.get_args
    assert set(args(config_module.RecipeName)) == set(RECIPES)
    assert set(args(config_module.AdvantageEstimator)) == set(ADVANTAGE_ESTIMATORS) - {"grpo_process"}
    assert set(args(config_module.LossAggMode)) == set(LOSS_AGG_MODES)
    assert set(args(config_module.RatioLevel)) == set(RATIO_LEVELS)
    assert set(args(config_module.TisLevelSetting)) == set(TIS_LEVELS) | {"off"}
    assert set(args(config_module.TisMode)) == set(TIS_MODES)


def test_knobs_reach_the_recipe():
    a = algorithm("recipe=grpo", "advantage_estimator=rloo", "loss_agg_mode=token-mean", "ratio_level=sequence",
                  "mask_truncated=true", "tis_level=sequence", "tis_mode=mask", "tis_upper=3.0", "tis_lower=0.5",
                  "overlong_max_length=5", "overlong_buffer_length=2", "overlong_penalty_factor=0.5")
    assert (a.advantage_estimator, a.loss.loss_agg_mode, a.loss.ratio_level, a.mask_truncated) == (
        "rloo", "token-mean", "sequence", True)
    assert (a.loss.tis_level, a.loss.tis_mode, a.loss.tis_upper, a.loss.tis_lower) == ("sequence", "mask", 3.0, 0.5)
    assert (a.overlong_max_length, a.overlong_buffer_length, a.overlong_penalty_factor) == (5, 2, 0.5)
    assert algorithm("loss_agg_mode=seq-mean-token-sum-norm").loss.l_norm == 6  # Dr. GRPO: the budget
    assert algorithm("advantage_estimator=reinforce_plus_plus_baseline").advantage_estimator == (
        "reinforce_plus_plus_baseline")
    plain = algorithm()  # nothing set: the recipe's values (dapo)
    assert (plain.advantage_estimator, plain.loss.ratio_level, plain.loss.tis_level, plain.mask_truncated) == (
        "grpo", "token", None, False)


@pytest.mark.parametrize("item, message", [
    ("advantage_estimator=gae", "rl.advantage_estimator: 'gae' is not one of 'grpo', 'dr_grpo', 'rloo'"),
    ("advantage_estimator=grpo_process", "rl.advantage_estimator: 'grpo_process' is not one of"),
    ("loss_agg_mode=mean", "rl.loss_agg_mode: 'mean' is not one of 'token-mean'"),
    ("ratio_level=seq", "rl.ratio_level: 'seq' is not one of 'token', 'sequence', 'sequence_token'"),
    ("tis_level=batch", "rl.tis_level: 'batch' is not one of 'token', 'sequence', 'off'"),
    ("tis_mode=clip", "rl.tis_mode: 'clip' is not one of 'truncate', 'mask'"),
    ("max_staleness=-1", "rl.max_staleness must be an integer >= 0"),
    ("overlong_max_length=0", "rl.overlong_max_length must be an integer >= 1"),
    ("overlong_penalty_factor=-1", "rl.overlong_penalty_factor must be a finite number >= 0"),
    ("tis_lower=1.5", "rl.tis_lower must be in (0, 1)"),
    ("tis_upper=1.0", "rl.tis_upper must be > 1"),
])
def test_bad_values_name_the_key_and_the_choices(item, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"rl.{item}"])
    assert message in str(info.value)
    key, text = item.split("=")
    value = text if text.isidentifier() else float(text) if "." in text else int(text)
    with pytest.raises(ConfigError, match=f"rl.{key}"):  # built directly, validate() says the same
        RLConfig(**{key: value}).validate("rl")


def test_inconsistent_tis_and_overlong_settings_are_refused():
    with pytest.raises(ConfigError, match="tis_upper has no effect with tis_level=off"):
        load_config(None, ["rl.tis_level=off", "rl.tis_upper=2.0"])
    with pytest.raises(ConfigError, match="tis_mode has no effect: TIS is off"):
        algorithm("tis_mode=mask")
    with pytest.raises(ConfigError, match="overlong shaping would never apply"):
        load_config(None, ["rl.overlong_max_length=20480", "rl.overlong_buffer_length=4096"])  # budget 6
    assert load_config(None, ["rl.tis_level=off"]).rl.tis_level == "off"  # YAML's bare `off` is false


def test_overlong_lengths_follow_the_generation_budget():
    """DAPO: L_max = 20480 = its generation budget, L_cache = 4096 = a fifth of it."""
    assert (RECIPES["dapo"].overlong_max_length, RECIPES["dapo"].overlong_buffer_length) == (20480, 4096)
    for budget, expected in ((20480, (20480, 4096)), (16384, (16384, 3277)), (6, (6, 1)), (2, (2, 1))):
        a = algorithm(f"max_response_tokens={budget}")
        assert (a.overlong_max_length, a.overlong_buffer_length) == expected
    a = algorithm("max_response_tokens=100", "overlong_max_length=90")
    assert (a.overlong_max_length, a.overlong_buffer_length) == (90, 18)
    a = algorithm("max_response_tokens=100", "overlong_buffer_length=30")
    assert (a.overlong_max_length, a.overlong_buffer_length) == (100, 30)
    a = algorithm("overlong_penalty_factor=0")
    assert a.overlong_max_length is None and a.overlong_buffer_length is None  # shaping off
    assert algorithm("recipe=grpo").overlong_max_length is None  # grpo does not shape
    a = algorithm("recipe=grpo", "max_response_tokens=50", "overlong_max_length=50")
    assert (a.overlong_max_length, a.overlong_buffer_length) == (50, 10)


def test_max_staleness_turns_on_the_decoupled_objective():
    assert algorithm().loss.tis_level is None and load_config(None).rl.max_staleness == 0
    a = recipe_for(RLConfig(max_staleness=2)).loss
    assert (a.tis_level, a.tis_mode, a.tis_upper) == ("token", "truncate", 2.0)
    assert recipe_for(RLConfig(max_staleness=1, tis_upper=4.0)).loss.tis_upper == 4.0
    assert recipe_for(RLConfig(max_staleness=1, tis_level="sequence")).loss.tis_level == "sequence"
    assert recipe_for(RLConfig(max_staleness=1, tis_level=False)).loss.tis_level is None  # the user's choice: off
    legacy = algorithm("tis_upper=2.0").loss  # tis_upper alone turns token-level TIS on, as before
    assert (legacy.tis_level, legacy.tis_upper) == ("token", 2.0)


def test_olmo3_recipe():
    a = algorithm("recipe=olmo3")
    assert (a.advantage_estimator, a.loss.loss_agg_mode, a.loss.ratio_level) == ("dr_grpo", "token-mean", "token")
    assert (a.loss.eps_low, a.loss.eps_high, a.loss.kl_coef) == (0.2, 0.3, 0.0)
    assert (a.loss.tis_level, a.loss.tis_mode, a.loss.tis_upper) == ("token", "truncate", 2.0)
    assert a.dynamic_sampling and a.overlong_max_length is None and "2512.13961" in a.paper
    assert algorithm("recipe=olmo3", "tis_level=off").loss.tis_level is None


def test_zero_std_group_fraction_with_or_without_dynamic_sampling():
    def group(*rewards):
        return [Trajectory(group=0, prompt_ids=[1], response_ids=[2], rollout_logprobs=[0.0], truncated=False,
                           reward=r) for r in rewards]

    groups = [group(1.0, 1.0), group(0.0, 1.0), group(0.0, 0.0), group(0.5, 0.0)]
    assert rollout_metrics(groups)["rollout/zero_std_group_frac"] == 0.5
    assert rollout_metrics([group(0.0, 1.0)])["rollout/zero_std_group_frac"] == 0.0
