"""`megatron-rl eval` reads checkpoints and settings it did not write; what it takes from them
(a run's trainer_state.json, an export's megatron_rl_export.json, a set's threshold and params,
--n, --seed) is checked by type and bound before any engine starts, each refusal one line naming
the file or option, the key and the value.

Before, each of these passed `prepare`: a `config` of the wrong kind failed with a TypeError
traceback, and a NaN step, a NaN or infinite threshold, a NaN reward param or a negative seed
ran the whole evaluation and failed only when eval.json (strict JSON) or the bootstrap's
generator met them, the evaluation lost; --n 10**8 reached the engine. Each case runs the CLI in
this process with the engine stage replaced by one that fails the test if reached. What eval
takes from a run's recorded rewards: test_recorded_rewards.py."""

from __future__ import annotations

import pytest

from stand_ins import refused, stand_in_hf, stand_in_run


@pytest.mark.parametrize("state, named", [
    ('{"step": NaN, "config": {}}', "'step' must be an integer >= 0, not nan"),
    ('{"step": 1, "config": "model data"}', "'config' must be an object"),
    ('{"step": 1, "config": {"rewards": [1, 2]}}', "'config.rewards' must be an object"),
])
def test_a_trainer_state_of_the_wrong_kind_is_refused_by_file_and_key(no_engine, capsys, prompts, tmp_path, state,
                                                                       named):
    run = stand_in_run(tmp_path, state)
    err = refused(capsys, "--ckpt", str(run), "--set", f"a={prompts}", "--out", str(tmp_path / "out"))
    assert f"--ckpt {run}: {run}/checkpoints/step_000001/trainer_state.json: {named}" in err, err


@pytest.mark.parametrize("export, named", [
    ('{"step": NaN}', "megatron_rl_export.json is unreadable (NaN is not a JSON number)"),
    ('{"step": 3, "eval_temperature": 1e999}', "megatron_rl_export.json is unreadable (1e999 is beyond"),
    ('{"step": "7"}', "megatron_rl_export.json: 'step' must be an integer >= 0 or null, not \"7\""),
    ('{"run": {"a": 1}}', "megatron_rl_export.json: 'run' must be a string or null"),
    ('{"prompt_format": "markdown"}', "megatron_rl_export.json: 'prompt_format' must be one of raw, chat"),
    ('[1, 2]', "megatron_rl_export.json must be a JSON object, not list"),
])
def test_an_export_record_of_the_wrong_kind_is_refused_by_file_and_key(no_engine, capsys, prompts, tmp_path, export,
                                                                        named):
    model = stand_in_hf(tmp_path, export)
    err = refused(capsys, "--ckpt", str(model), "--set", f"a={prompts}", "--out", str(tmp_path / "out"))
    assert f"--ckpt {model}: {model}/{named}" in err, err


@pytest.mark.parametrize("argv, named", [
    (["set.a.threshold=.nan"], "set 'a': threshold must be a finite number (reward >= threshold: correct), got nan"),
    (["set.a.threshold=.inf"], "set 'a': threshold must be a finite number (reward >= threshold: correct), got inf"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--n", "100000000", "--k", "1"], "--n must be at most 1024 samples per prompt, got 100000000"),
    (["set.a.n=5000"], "set 'a': n must be at most 1024 samples per prompt (rl.eval.n's bound), got 5000"),
    (["set.a.reward={reward}:score", "set.a.reward_params.scale=.nan"],
     "set 'a': reward_params.scale is nan, not a finite number; the report (eval.json, strict JSON) could not "
     "record it"),
])
def test_settings_the_report_cannot_hold_or_the_engine_should_not_run_are_refused(no_engine, capsys, prompts,
                                                                                  tmp_path, argv, named):
    reward = tmp_path / "scale_reward.py"
    reward.write_text("def score(prompt, response, answer, scale=1.0, **metadata):\n    return scale\n")
    model = stand_in_hf(tmp_path)
    argv = [item.format(reward=reward) for item in argv]
    err = refused(capsys, "--ckpt", str(model), "--set", f"a={prompts}", "--out", str(tmp_path / "out"), *argv)
    assert named in err, err


@pytest.mark.parametrize("options, named", [
    ("{path: 5}", "set 'a': path must be text, got 5"),
    ("{path: PROMPTS, reward: 5}", "set 'a': reward must be text, got 5"),
    ("{path: PROMPTS, prompt_key: {x: 1}}", "set 'a': prompt_key must be text, got {'x': 1}"),
])
def test_a_sets_files_text_option_of_another_type_is_refused_by_name(no_engine, capsys, prompts, hf_dir, tmp_path,
                                                                      options, named):
    """YAML gives a --sets file's options any type; before, these were a TypeError or AttributeError."""
    sets = tmp_path / "sets.yaml"
    sets.write_text("a: " + options.replace("PROMPTS", str(prompts)) + "\n")
    err = refused(capsys, "--ckpt", str(hf_dir), "--sets", str(sets), "--out", str(tmp_path / "out"))
    assert named in err, err
