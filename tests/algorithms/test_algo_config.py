"""PolicyLossConfig validation and aliases; named recipes carry their papers' settings."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_rl.algorithms import RECIPES, PolicyLossConfig, recipe


@pytest.mark.parametrize("field,value", [
    ("policy_loss_type", "grpo"), ("ratio_level", "seq"), ("loss_agg_mode", "mean"), ("tis_level", "batch"),
    ("tis_mode", "clip"), ("on_nonfinite", "ignore"), ("kl_loss_type", "k4"), ("eps_low", -0.1),
    ("eps_high", float("nan")), ("dual_clip_c", 1.0), ("log_ratio_clamp", 0.0), ("kl_coef", -1.0),
    ("kl_input_clamp", -1.0), ("kl_output_clamp", 0.0), ("entropy_coef", float("inf")), ("tis_upper", 0.0),
    ("tis_lower", -0.5),
])
def test_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        PolicyLossConfig(**{field: value})


def test_cross_field_validation():
    with pytest.raises(ValueError, match="tis_lower"):
        PolicyLossConfig(tis_lower=2.0, tis_upper=2.0)
    with pytest.raises(ValueError, match="CISPO"):
        PolicyLossConfig(policy_loss_type="cispo", ratio_level="sequence")
    with pytest.raises(ValueError, match="dual_clip_c"):
        PolicyLossConfig(policy_loss_type="cispo", dual_clip_c=3.0)
    with pytest.raises(ValueError, match="l_norm"):
        PolicyLossConfig(l_norm=100.0)  # token-mean does not use it
    assert PolicyLossConfig(l_norm=100.0, loss_agg_mode="seq-mean-token-sum-norm").l_norm == 100.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        PolicyLossConfig().eps_low = 0.3


def test_from_dict_aliases():
    cfg = PolicyLossConfig.from_dict({
        "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, "kl_loss_coef": 0.001,
        "use_kl_loss": True, "kl_loss_type": "low_var_kl", "entropy_coeff": 0.01, "loss_agg_mode": "token-mean",
    })
    assert (cfg.eps_low, cfg.eps_high, cfg.dual_clip_c, cfg.kl_coef, cfg.kl_loss_type, cfg.entropy_coef) == (
        0.2, 0.28, 3.0, 0.001, "k3", 0.01)
    assert PolicyLossConfig.from_dict({"kl_loss_type": "mse"}).kl_loss_type == "k2"
    assert PolicyLossConfig.from_dict({"kl_loss_type": "kl"}).kl_loss_type == "k1"
    assert PolicyLossConfig(kl_loss_type="low_var_kl+").kl_loss_type == "k3+"
    sym = PolicyLossConfig.from_dict({"clip_ratio": 0.1, "clip_ratio_high": 0.3})
    assert (sym.eps_low, sym.eps_high) == (0.1, 0.3)
    trl = PolicyLossConfig.from_dict({"epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.04})
    assert (trl.eps_low, trl.eps_high, trl.kl_coef) == (0.2, 0.28, 0.04)
    assert PolicyLossConfig.from_dict({"kl_loss_coef": 0.5, "use_kl_loss": False}).kl_coef == 0.0
    assert PolicyLossConfig.from_dict({"clip_ratio_c": float("inf")}).dual_clip_c is None
    gspo = PolicyLossConfig.from_dict({"loss_mode": "gspo"})
    assert (gspo.policy_loss_type, gspo.ratio_level) == ("ppo", "sequence_token")
    assert PolicyLossConfig.from_dict({"loss_mode": "cispo"}).policy_loss_type == "cispo"
    with pytest.raises(ValueError, match="unknown PolicyLossConfig key 'clip_eps'"):
        PolicyLossConfig.from_dict({"clip_eps": 0.2})
    with pytest.raises(ValueError, match="conflicts"):
        PolicyLossConfig.from_dict({"eps_high": 0.2, "clip_ratio_high": 0.28})
    with pytest.raises(ValueError, match="use_kl_loss=True needs"):
        PolicyLossConfig.from_dict({"use_kl_loss": True})
    with pytest.raises(ValueError, match="loss_mode"):
        PolicyLossConfig.from_dict({"loss_mode": "clip_cov"})


def test_recipes_follow_their_papers():
    g = recipe("grpo")
    assert (g.advantage_estimator, g.loss.loss_agg_mode, g.loss.ratio_level) == ("grpo", "seq-mean-token-mean", "token")
    assert (g.loss.eps_low, g.loss.eps_high, g.loss.kl_coef, g.loss.kl_loss_type) == (0.2, 0.2, 0.04, "k3")
    d = recipe("dr_grpo")
    assert (d.advantage_estimator, d.loss.loss_agg_mode, d.loss.kl_coef) == ("dr_grpo", "seq-mean-token-sum-norm", 0.0)
    a = recipe("dapo")
    assert (a.loss.eps_low, a.loss.eps_high, a.loss.loss_agg_mode, a.loss.kl_coef) == (0.2, 0.28, "token-mean", 0.0)
    assert a.dynamic_sampling and (a.overlong_max_length, a.overlong_buffer_length) == (20480, 4096)
    s = recipe("gspo")
    assert (s.loss.ratio_level, s.loss.eps_low, s.loss.eps_high, s.loss.loss_agg_mode) == (
        "sequence", 3e-4, 4e-4, "seq-mean-token-mean")
    c = recipe("cispo")
    assert (c.loss.policy_loss_type, c.loss.eps_low, c.loss.loss_agg_mode) == ("cispo", 1.0, "token-mean")
    assert set(RECIPES) == {"grpo", "dr_grpo", "dapo", "gspo", "cispo", "olmo3"}
    assert all(r.paper for r in RECIPES.values())


def test_recipe_overrides():
    r = recipe("dr_grpo", l_norm=8192, dynamic_sampling=True)
    assert r.loss.l_norm == 8192 and r.dynamic_sampling and r.loss.loss_agg_mode == "seq-mean-token-sum-norm"
    r = recipe("dapo", clip_ratio_high=0.3, kl_loss_type="mse")
    assert (r.loss.eps_low, r.loss.eps_high, r.loss.kl_loss_type) == (0.2, 0.3, "k2")
    assert recipe("grpo", kl_coef=0.0).loss.kl_coef == 0.0
    assert recipe("grpo").loss.kl_coef == 0.04  # overrides never leak into the registry
    with pytest.raises(ValueError, match="recipe name"):
        recipe("ppo")
    with pytest.raises(ValueError, match="unknown PolicyLossConfig key 'lr'"):
        recipe("grpo", lr=1e-6)
    with pytest.raises(ValueError, match="l_norm"):
        recipe("dapo", l_norm=100.0)  # token-mean has no L_norm
    with pytest.raises(ValueError, match="advantage_estimator"):
        recipe("grpo", advantage_estimator="gae")
    with pytest.raises(ValueError, match="overlong_buffer_length"):
        recipe("dapo", overlong_buffer_length=None)
