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


def agent_run(*overrides: str):
    """A multi-turn run: the calculator tool, 3 turns of at most 80 model tokens, 256 tokens in all."""
    return load_config(None, ["rollout.tools=[calculator]", "rollout.max_turns=3", "rollout.max_total_tokens=256",
                              "rl.max_response_tokens=80", "data.prompt_format=chat", *overrides])


def test_multi_turn_shaping_measures_the_trajectorys_model_tokens_not_one_turns():
    """Overlong shaping and Dr. GRPO's L_norm measure a trajectory's model tokens (observations
    excluded), so their budget is the model turns together. Measured against one turn's cap
    (80), a tool call (~65 model tokens) plus the answer turn lands in the penalty ramp: every
    tool-calling trajectory was shaped toward -1 and RL drove the tool-call rate down."""
    from megatron_rl.train.experience import group_advantages

    config = agent_run()
    assert config.response_budget == 240  # 3 x 80, below max_total_tokens=256
    assert agent_run("rollout.max_total_tokens=200").response_budget == 200
    assert load_config(None, ["rl.max_response_tokens=80"]).response_budget == 80  # single-turn: one turn
    recipe = recipe_for(config.rl, config.response_budget)
    assert (recipe.overlong_max_length, recipe.overlong_buffer_length) == (240, 48)

    def group() -> list[Trajectory]:
        """A correct tool call + answer (73 model tokens around 12 observation tokens), a wrong
        direct answer (7), and a rambling wrong trajectory in the ramp (216 model tokens)."""
        masks = ([1] * 66 + [0] * 12 + [1] * 7, [1] * 7, [1] * 100 + [0] * 20 + [1] * 116)
        return [Trajectory(0, [1], list(range(len(mask))), [0.0] * len(mask), False, reward, loss_mask=list(mask))
                for mask, reward in zip(masks, (1.0, 0.0, 0.0))]

    def advantages(rows: list[Trajectory], chosen) -> list[float]:
        group_advantages([rows], chosen)
        return [t.advantage for t in rows]

    shaped = advantages(group(), recipe)
    # the same group's rewards shaped by hand: 216 model tokens are 24 into the 48-token ramp
    # (-0.5); 73 are nowhere near it. Plain rewards through the same estimator, shaping off.
    by_hand = group()
    by_hand[2].reward = -0.5
    plain = recipe_for(agent_run("rl.overlong_penalty_factor=0").rl, config.response_budget)
    assert plain.overlong_max_length is None
    assert shaped == pytest.approx(advantages(by_hand, plain), abs=1e-12)
    # measured against one turn's cap (the defect), the correct tool call itself is shaped:
    per_turn = recipe_for(config.rl)
    assert per_turn.overlong_max_length == 80
    wrong = advantages(group(), per_turn)
    assert wrong[0] < shaped[0] - 0.1

    # Dr. GRPO divides by the same budget
    assert recipe_for(agent_run("rl.recipe=dr_grpo").rl, config.response_budget).loss.l_norm == 240
    # explicit lengths are checked against the trajectory's budget: 150 > one turn's 80 applies here
    assert recipe_for(agent_run("rl.overlong_max_length=150").rl, 240).overlong_max_length == 150
    with pytest.raises(ConfigError, match="never apply.*the 240 model tokens a trajectory can hold"):
        agent_run("rl.overlong_max_length=400")
