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


@pytest.mark.parametrize(
    "override, message",
    [
        # rank 2,000,000 held 6.15 GB after 10 s; 10^9 died in the allocator (preflight also bounds it by the
        # model's own layer widths: tests/train/test_preflight_outputs.py)
        ("model.lora.rank=2000000", "model.lora.rank must be at most 65536 (the adapters' inner dimension"),
        # merged weights W + (alpha / rank) B A overflowed to infinity
        ("model.lora.alpha=1e308", "model.lora.alpha must be at most 1e+06 (the merged weight is W + (alpha / rank) B A"),
        ("model.lora.alpha=.inf", "model.lora.alpha must be a finite number > 0"),
        # vLLM sampled greedily: every group identical, 0 updates on every step, exit 0
        ("rl.temperature=1e-6", "rl.temperature=1e-06 samples greedily in practice: every sample of a group would be "
                                "the same answer, every advantage 0 and no update taken"),
        ("rl.group_size=1000000000", "rl.group_size must be at most 1024"),
        ("rl.prompts_per_step=1048576", "prompts_per_step x group_size = 1048576 x 8 samples per step is beyond 1048576"),
        ("rl.max_response_tokens=1000000000", "rl.max_response_tokens must be at most 16777216"),
        ("rollout.max_model_len=1000000000000", "rollout.max_model_len must be at most 268435456"),
        ("rollout.num_servers=100000", "rollout.num_servers must be at most 1024 (vLLM or SGLang server processes"),
        ("rollout.server_tp=100000", "rollout.server_tp must be at most 1024"),
        ("rollout.env_workers=1000000", "rollout.env_workers must be at most 1024 (threads running environment calls)"),
        ("rollout.weight_bucket_mb=1000000000", "rollout.weight_bucket_mb must be at most 1048576"),
        ("rollout.cpu_kv_cache_gib=1e9", "rollout.cpu_kv_cache_gib must be at most 16384"),
        ("rollout.cpu_kv_cache_gib=.nan", "rollout.cpu_kv_cache_gib must be a finite number > 0, got nan"),
        ("rollout.request_timeout_s=.nan", "rollout.request_timeout_s must be a finite number > 0, got nan"),
        ("rollout.overgeneration_groups=100000000", "rollout.overgeneration_groups must be at most 65536"),
        ("model.make_vocab_size_divisible_by=1000000000000", "model.make_vocab_size_divisible_by must be from 1 to 65536"),
        ("model.padded_vocab_size=1000000000000", "model.padded_vocab_size must be from 1 to 33554432"),
        ("warm_start.batch_size=1000000000", "warm_start.batch_size must be at most 65536"),
    ],
)
def test_numbers_that_would_allocate_before_any_useful_error_are_bounded_by_name(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert message in str(info.value), str(info.value)
    assert str(info.value).startswith(f"command line ({override}): ")


def test_the_bounds_leave_every_usual_setting_alone():
    config = load_config(None, ["model.lora.rank=64", "model.lora.alpha=128", "rl.temperature=0.05", "rl.group_size=1024",
                                "rl.prompts_per_step=1024", "rollout.max_model_len=131072"])
    assert (config.model.lora.rank, config.rl.temperature, config.rl.group_size) == (64, 0.05, 1024)


# --------------------------------------------------------------------------- untrusted YAML (issue 57)

BOMB = """rollout:
  environment: my_envs:Env
  environment_args:
    a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
    b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
    c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
    d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
    e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
    f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
    g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
"""


def test_a_yaml_alias_bomb_is_refused_before_anything_expands_it(tmp_path):
    """Ten lines that expand to 9^7 strings in a free-form mapping: PyYAML builds them as shared
    references at once, and the checkpoint's copy of the config (dataclasses.asdict) expanded them
    (2.35 GB after 150 s). Refused by the loader, naming the file, the key and the line, before any
    setting is read; an override carrying a bomb is refused the same way."""
    from megatron_rl.config.loader import MAX_ALIAS_NODES

    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: rollout.environment_args.f[0] (line 9): YAML aliases expand the "
                                      f"document by more than {MAX_ALIAS_NODES:,} nodes"), str(info.value)
    override = "rollout.environment_args=" + "{" + ", ".join(BOMB.splitlines()[3:]).replace("    ", "") + "}"
    with pytest.raises(ConfigError, match=r"^override 'rollout\.environment_args=.*': f\[0\] \(line 1\): YAML aliases "
                                          r"expand the document"):
        load_config(None, ["rollout.environment=my_envs:Env", override])


FREE_FORM = "rollout:\n  environment: my_envs:Env\n  environment_args:\n"  # a mapping any value fits


# Under a free-form mapping, where nothing else would refuse them: before the loader's checks a
# recursive alias loaded there and crashed later, when the checkpoint copied the config.
@pytest.mark.parametrize("text, message", [
    (FREE_FORM + "    a: &a [1, *a]\n", "rollout.environment_args.a[1] (line 4): an alias refers to a node that contains it"),
    ("x: " + "[" * 10_000 + "]" * 10_000 + "\n", "line 1: nested more than 100 levels deep"),
    (FREE_FORM + "    x: &x " + "[" * 60 + "]" * 60 + "\n    y: &y " + "[" * 60 + "*x" + "]" * 60 + "\n",
     "rollout.environment_args.y" + "[0]" * 60 + " (line 5): nested more than 100 levels deep through aliases"),
])
def test_recursive_aliases_and_deep_nesting_are_refused_by_line(tmp_path, text, message):
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: {message}" or str(info.value).startswith(f"{path}: {message}"), str(info.value)


def test_honest_aliases_and_merges_still_load(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text("rollout:\n  environment: my_envs:Env\n  environment_args:\n"
                    "    common: &common {tools: [calc, search], max_turns: 4}\n"
                    "    train: {<<: *common, seed: 1}\n    heldout: *common\n")
    args = load_config(path).rollout.environment_args
    assert args["train"] == {"tools": ["calc", "search"], "max_turns": 4, "seed": 1}
    assert args["heldout"] == args["common"]


PATHS = ["/runs/victim #new-experiment", "2024-01-01", "yes", "no", "null", "~", "42", "1e3", "a\nb",
         "[a, b]", "{a: 1}", " spaced ", "x: y"]


@pytest.mark.parametrize("text", PATHS)
def test_a_text_key_given_on_the_command_line_is_taken_as_written(text):
    """A key the tree types as text (a path, a name) gets the override's text verbatim: YAML
    stripped `#...` as a comment (`output_dir=/runs/victim #new-experiment` wrote into
    /runs/victim), read dates and booleans (refused), folded a newline into a space."""
    config = load_config(None, [f"output_dir={text}", f"model.hf_config={text}", f"data.train={text}"])
    assert config.output_dir == config.model.hf_config == config.data.train == text


@pytest.mark.parametrize("text", ["yes", "no", "null", "on"])
def test_a_name_mapping_value_on_the_command_line_is_text(text):
    assert load_config(None, [f"data.columns.field={text}"]).data.columns == {"field": text}


@pytest.mark.parametrize("text, value", [("null", None), ("~", None), ("", None), ("NULL", None),
                                         ("/ckpt #3", "/ckpt #3"), ("2024-01-01", "2024-01-01")])
def test_a_text_key_that_may_be_null_reads_null_and_otherwise_the_text(text, value):
    assert load_config(None, [f"checkpoint.init_from={text}"]).checkpoint.init_from == value
    if value is not None:  # through an optional section too
        assert load_config(None, [f"rl.teacher.source={text}"]).rl.teacher.source == value


def test_other_keys_still_read_their_value_as_yaml_and_files_read_no_dates(tmp_path):
    config = load_config(None, ["rl.steps=3", "rollout.tools=[a, b]", "rl.routing_replay=true",
                                "rollout.environment=e:E", "rollout.environment_args.when=2024-01-01",
                                "rollout.environment_args.flag=yes"])
    assert (config.rl.steps, config.rollout.tools, config.rl.routing_replay) == (3, ["a", "b"], "training")
    assert config.rollout.environment_args == {"when": "2024-01-01", "flag": True}  # YAML, less its dates
    path = tmp_path / "dated.yaml"
    path.write_text("output_dir: 2024-01-01\n")
    assert load_config(path).output_dir == "2024-01-01"
    with pytest.raises(ConfigError, match=r"^override 'rl\.steps=\[1': not valid YAML"):
        load_config(None, ["rl.steps=[1"])
