"""The config tree: loading, overrides, and errors that name the file and key."""

import pytest

from _support.processes import REPO
from megatron_rl.config import ParallelConfig, load_config

from megatron_rl.errors import ConfigError


def test_defaults_and_overrides():
    config = load_config(None, ["parallel.tp=2", "model.precision=bf16", "optimizer.lr=3e-6"])
    assert config.parallel.tp == 2 and config.parallel.uses_sequence_parallel
    assert config.parallel.expert_tp == 2  # etp defaults to tp
    assert config.model.precision == "bf16"
    assert config.optimizer.lr == pytest.approx(3e-6)


def test_yaml_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 7\nparallel:\n  ep: 2\n  etp: 1\nmodel:\n  hf_config: tiny-qwen3\n")
    config = load_config(path)
    assert (config.seed, config.parallel.ep, config.parallel.etp, config.model.hf_config) == (7, 2, 1, "tiny-qwen3")


@pytest.mark.parametrize(
    "text, message",
    [
        ("parallel:\n  tpp: 2\n", "unknown key 'parallel.tpp'; did you mean 'tp'?"),
        ("model:\n  precision: fp16\n", "model.precision: 'fp16' is not one of"),
        ("optimizer:\n  lr: fast\n", "optimizer.lr: expected a number"),
        ("parallel:\n  tp: 0\n", "parallel.tp must be >= 1"),
        ("- a\n- b\n", "the top level must be a mapping"),
        ("parallel: [1\n", "not valid YAML"),
    ],
)
def test_errors_name_file_and_key(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("no/such/recipe.yaml")


def test_moe_tp_without_expert_tp_or_ep_is_rejected():
    parallel = ParallelConfig(tp=2, ep=1, etp=1)
    with pytest.raises(ConfigError, match="trains MoE experts wrongly.*etp=2"):
        parallel.validate_for_model("parallel", num_experts=4)
    ParallelConfig(tp=2, ep=1, etp=2).validate_for_model("parallel", num_experts=4)
    ParallelConfig(tp=2, ep=2, etp=1).validate_for_model("parallel", num_experts=4)


def test_world_size_checks():
    ParallelConfig(tp=2, ep=2).validate_world_size(4)
    with pytest.raises(ConfigError, match="not divisible by tp\\*pp\\*cp"):
        ParallelConfig(tp=2, pp=2).validate_world_size(6)
    with pytest.raises(ConfigError, match="not divisible by etp\\*ep\\*pp"):
        ParallelConfig(tp=1, ep=4).validate_world_size(2)
    assert ParallelConfig(tp=2).data_parallel_size(8) == 4


def test_expert_count_must_divide():
    with pytest.raises(ConfigError, match="ep=3 must divide the number of experts"):
        ParallelConfig(ep=3).validate_for_model("parallel", num_experts=4)
    with pytest.raises(ConfigError, match="only meaningful for MoE"):
        ParallelConfig(ep=2).validate_for_model("parallel", num_experts=None)


RECIPES = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_validate(recipe):
    assert RECIPES, "configs/ has no recipes"
    load_config(recipe)


@pytest.mark.parametrize(
    "text, key, lines",
    [
        ("seed: 1\nparallel:\n  tp: 2\nseed: 2\n", "'seed'", (1, 4)),
        ("parallel:\n  tp: 2\n  ep: 1\n  tp: 4\n", "'tp'", (2, 4)),  # nested mappings too
    ],
)
def test_duplicate_keys_are_refused(tmp_path, text, key, lines):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message and key in message
    assert f"line {lines[0]}" in message and f"line {lines[1]}" in message


def test_same_key_in_different_sections_and_merge_overrides_are_fine(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("optimizer:\n  lr: 0.001\nwarm_start:\n  lr: 0.01\n")
    config = load_config(path)
    assert config.optimizer.lr == pytest.approx(0.001) and config.warm_start.lr == pytest.approx(0.01)
    # Overriding a key brought in by a YAML merge (`<<: *anchor`) is not a duplicate.
    from megatron_rl.config.loader import _read_yaml

    path.write_text("base: &b {a: 1, b: 2}\nderived:\n  <<: *b\n  b: 3\n")
    assert _read_yaml(path)["derived"] == {"a": 1, "b": 3}


def test_config_that_is_a_directory(tmp_path):
    with pytest.raises(ConfigError, match="is a directory.*expects a YAML file"):
        load_config(tmp_path)


@pytest.mark.parametrize(
    "override, message",
    [
        ("optimizer.adam_beta1=2.0", "optimizer.adam_beta1 must be in [0, 1)"),
        ("optimizer.adam_beta2=-0.1", "optimizer.adam_beta2 must be in [0, 1)"),
        ("optimizer.clip_grad=-1", "optimizer.clip_grad must be >= 0"),
        # NaN passes every comparison; an infinite or absurd rate diverged a run in one update.
        ("optimizer.lr=.nan", "optimizer.lr must be a finite number, got nan"),
        ("optimizer.lr=.inf", "optimizer.lr must be a finite number, got inf"),
        ("optimizer.lr=1e30", "optimizer.lr must be a finite number in (0, 1], got 1e+30"),
        ("optimizer.min_lr=.nan", "optimizer.min_lr must be a finite number, got nan"),
        ("optimizer.clip_grad=.inf", "optimizer.clip_grad must be a finite number"),
        ("warm_start.lr=.nan", "warm_start.lr must be a finite number in (0, 1], got nan"),
        ("rl.max_bad_steps=0", "rl.max_bad_steps must be >= 1"),
        ("rl.max_weight_norm_growth=1", "rl.max_weight_norm_growth must be a finite factor > 1 (or 0: no check)"),
        ("rl.max_weight_norm_growth=.nan", "rl.max_weight_norm_growth must be a finite factor > 1"),
    ],
)
def test_optimizer_ranges(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert message in str(info.value)


@pytest.mark.parametrize(
    "override, message",
    [
        # The trainer trains on softmax(logits / rl.temperature), which greedy decoding does not have.
        ("rl.temperature=0", "rl.temperature must be a finite number > 0, got 0"),
        ("rl.temperature=.nan", "rl.temperature must be a finite number > 0, got nan"),
        ("rl.temperature=-0.5", "rl.temperature must be a finite number > 0, got -0.5"),
        # Nucleus sampling is refused for training (docs/algorithms.md says why).
        ("rl.top_p=0.9", "rl.top_p=0.9: nucleus sampling is not supported for training; set rl.top_p=1"),
        ("rl.eval_temperature=-1", "rl.eval_temperature must be a finite number >= 0 (0: greedy), got -1"),
    ],
)
def test_sampling_settings_the_trainer_cannot_train_on_are_refused(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert message in str(info.value)


def test_sampling_temperature_and_greedy_evaluation_are_accepted():
    config = load_config(None, ["rl.temperature=0.6", "rl.eval_temperature=0"])
    assert (config.rl.temperature, config.rl.eval_temperature, config.rl.top_p) == (0.6, 0.0, 1.0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        # The audit's run: x -29 per warm-start update, finite weights of 8.5e14 checkpointed.
        (["optimizer.lr=1", "optimizer.weight_decay=1e4"],
         "optimizer.weight_decay=10000 is too large for the learning rate: with optimizer.lr=1 every weight is "
         "multiplied by 1 - lr x weight_decay = -9999 at each update; with warm_start.lr=0.003 every weight is "
         "multiplied by 1 - lr x weight_decay = -29 at each update"),
        # The warm start's rate alone: the one the decay runs at first.
        (["optimizer.weight_decay=400"], "with warm_start.lr=0.003 every weight is multiplied by 1 - lr x "
                                         "weight_decay = -0.2"),
    ],
)
def test_weight_decay_that_flips_or_grows_the_weights_is_refused(overrides, message):
    """AdamW multiplies every weight by 1 - lr x weight_decay per update: from 1 on the weights flip
    sign, from 2 on they grow geometrically (config/run.py)."""
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value) and "Keep lr x weight_decay below 1" in str(info.value)
    load_config(None, ["optimizer.weight_decay=400", "warm_start.steps=0"])  # 400 x 5e-4 = 0.2: no warm start, fine
    load_config(None, ["optimizer.weight_decay=0.1"])
