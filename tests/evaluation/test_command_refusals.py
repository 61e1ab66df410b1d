"""`megatron-rl eval` refuses bad input by name before any engine starts: a set whose column is
missing (the set, the file, the field and the option to set), k > n (both), a checkpoint path that
is not one (the path and the kinds accepted), n < 1, an unknown set option, an output directory
that cannot be written, two sets with one name, a reward that needs a field the set lacks, the set
PATH `heldout` for checkpoints whose runs' held-out sets differ or with a reading option (and,
read without an engine, what `heldout` is: the checkpoint's run's held-out set, else --config's).

Each case runs the CLI in this process with the engine stage replaced by one that fails the test
if reached (`command.evaluate`), and must end in under 2 s (before torch is imported) with exit
status 2 and one line; a prompt too long for the engine's context is counted after the engine's
other checks (torch imported) and still refused before any engine starts."""

from __future__ import annotations

import json
import shutil

import pytest

from megatron_rl import cli
from megatron_rl.evaluation import command
from stand_ins import PRESETS, refused, stand_in_run


def test_a_set_whose_prompt_column_is_missing_is_named_with_the_option_to_set(no_engine, capsys, hf_dir, tmp_path):
    path = tmp_path / "questions.jsonl"
    path.write_text(json.dumps({"question": "1+2=", "answer": "3"}) + "\n")
    err = refused(capsys, "--ckpt", str(hf_dir), "--set", f"hard={path}", "--out", str(tmp_path / "out"))
    assert "set 'hard'" in err and f"{path} line 1" in err and "prompt key 'prompt'" in err and "'question'" in err
    assert "set.hard.prompt_key=FIELD" in err


def test_a_set_without_the_field_its_reward_reads_names_the_data_columns_key(no_engine, capsys, hf_dir, prompts,
                                                                              tmp_path):
    err = refused(capsys, "--ckpt", str(hf_dir), "--set", f"code={prompts}", "set.code.reward=code_tests",
                  "--out", str(tmp_path / "out"))
    assert "set 'code'" in err and "'tests'" in err and str(prompts) in err
    assert "set.code.columns.FIELD=tests" in err and "data.columns" in err


def test_k_above_n_names_both(no_engine, capsys, hf_dir, prompts, tmp_path):
    err = refused(capsys, "--ckpt", str(hf_dir), "--set", f"add={prompts}", "--n", "4", "--k", "1,8",
                  "--out", str(tmp_path / "out"))
    assert "set 'add'" in err and "--k 8" in err and "n=4" in err


def test_a_set_n_below_k_names_the_set_option(no_engine, capsys, hf_dir, prompts, tmp_path):
    err = refused(capsys, "--ckpt", str(hf_dir), "--set", f"add={prompts}", "--k", "4", "set.add.n=2",
                  "--out", str(tmp_path / "out"))
    assert "--k 4" in err and "n=2" in err and "set.add.n" in err


@pytest.mark.parametrize("value", [".inf", ".nan", "-1"])
def test_a_temperature_that_is_not_a_finite_number_from_zero(no_engine, capsys, hf_dir, prompts, tmp_path, value):
    """A sets file's YAML reads .inf and .nan as floats (the command line refuses them as text)."""
    sets = tmp_path / "sets.yaml"
    sets.write_text(f"add: {{path: {prompts}, temperature: {value}}}\n")
    err = refused(capsys, "--ckpt", str(hf_dir), "--sets", str(sets), "--out", str(tmp_path / "out"))
    assert "set 'add': temperature must be a finite number >= 0 (0: greedy)" in err


@pytest.mark.parametrize("flag", [["--n", "0"], ["set.add.n=0"]])
def test_n_below_one(no_engine, capsys, hf_dir, prompts, tmp_path, flag):
    err = refused(capsys, "--ckpt", str(hf_dir), "--set", f"add={prompts}", *flag, "--out", str(tmp_path / "out"))
    assert ("--n must be >= 1, got 0" in err) or ("set 'add': n must be an integer >= 1, got 0" in err)


def test_a_checkpoint_that_is_none_of_the_kinds_is_named_with_the_kinds(no_engine, capsys, prompts, tmp_path):
    stray = tmp_path / "notes"
    stray.mkdir()
    (stray / "readme.txt").write_text("not weights")
    err = refused(capsys, "--ckpt", str(stray), "--set", f"add={prompts}", "--out", str(tmp_path / "out"))
    assert f"--ckpt {stray} is not a checkpoint" in err and "readme.txt" in err
    for kind in ("a run directory", "a training checkpoint", "a converted Megatron checkpoint",
                 "a Hugging Face model directory"):
        assert kind in err


def test_a_missing_second_checkpoint_is_refused_before_the_first_is_evaluated(no_engine, capsys, hf_dir, prompts,
                                                                             tmp_path):
    err = refused(capsys, "--ckpt", str(hf_dir), "--ckpt", str(tmp_path / "gone"), "--set", f"add={prompts}",
                  "--out", str(tmp_path / "out"))
    assert f"--ckpt {tmp_path / 'gone'} does not exist" in err


def test_an_unknown_set_option_is_named_with_the_options(no_engine, capsys, hf_dir, prompts, tmp_path):
    err = refused(capsys, "--ckpt", str(hf_dir), "--set", f"add={prompts}", "set.add.temprature=0.5",
                  "--out", str(tmp_path / "out"))
    assert "set 'add' has no option 'temprature'" in err and "temperature" in err


def test_an_option_for_no_set(no_engine, capsys, hf_dir, prompts, tmp_path):
    err = refused(capsys, "--ckpt", str(hf_dir), "--set", f"add={prompts}", "set.sub.n=4",
                  "--out", str(tmp_path / "out"))
    assert "there is no set named 'sub'" in err


def test_two_sets_with_one_name(no_engine, capsys, hf_dir, prompts, tmp_path):
    err = refused(capsys, "--ckpt", str(hf_dir), "--set", f"add={prompts}", "--set", f"add={tmp_path / 'other.jsonl'}",
                  "--out", str(tmp_path / "out"))
    assert "a set named 'add' is given twice" in err and str(prompts) in err


def test_an_output_directory_that_cannot_be_written(no_engine, capsys, hf_dir, prompts, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    err = refused(capsys, "--ckpt", str(hf_dir), "--set", f"add={prompts}", "--out", str(blocker / "out"))
    assert f"--out {blocker / 'out'}" in err and "is not a directory" in err


def test_a_set_that_does_not_exist(no_engine, capsys, hf_dir, tmp_path):
    err = refused(capsys, "--ckpt", str(hf_dir), "--set", f"add={tmp_path / 'missing.jsonl'}",
                  "--out", str(tmp_path / "out"))
    assert "set 'add'" in err and "missing.jsonl does not exist" in err


def test_a_prompt_over_the_engines_context_names_the_set_and_line(no_engine, capsys, hf_dir, tmp_path):
    """Counted with the run's tokenizer after the engine's other checks, which import torch: seconds, not
    milliseconds, and still before any engine starts."""
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "1+2=", "answer": "3"}) + "\n" + json.dumps({"prompt": "1+" * 600 + "2=",
                                                                                       "answer": "3"}) + "\n")
    err = refused(capsys, "--ckpt", str(hf_dir), "--set", f"long={path}", "--out", str(tmp_path / "out"),
                  "rollout.max_model_len=512", within=30.0)
    assert "set 'long'" in err and f"{path} line 2" in err and "1 of the set's 2 prompts" in err
    assert "rollout.max_model_len=512" in err


def test_checkpoints_of_two_models_are_refused_before_one_engine_serves_both(no_engine, capsys, hf_dir, prompts,
                                                                              tmp_path):
    other = tmp_path / "llama"
    other.mkdir()
    shutil.copy(PRESETS / "tiny-llama.json", other / "config.json")
    (other / "model.safetensors").write_bytes(b"")
    err = refused(capsys, "--ckpt", str(hf_dir), "--ckpt", str(other), "--set", f"add={prompts}",
                  "--out", str(tmp_path / "out"))
    assert f"--ckpt {other} is another model than --ckpt {hf_dir}" in err and "separate" in err


def test_runs_with_different_rewards_need_the_sets_reward(no_engine, capsys, hf_dir, prompts, tmp_path):
    """A stand-in run directory (the files a training checkpoint is told apart by, its recorded config
    scoring with `math`) next to a Hugging Face directory under the tiny default (`synthetic`)."""
    stand_in_run(tmp_path, json.dumps({"step": 1, "config": {"rewards": {"terms": [{"name": "math"}]}}}))
    argv = ["--ckpt", str(tmp_path / "run"), "--ckpt", str(hf_dir), "--set", f"add={prompts}", "--out",
            str(tmp_path / "out")]
    err = refused(capsys, *argv)
    assert "set 'add'" in err and "different rewards" in err and "set.add.reward=NAME" in err
    # Naming the set's reward is the way out: the checks then pass (the engine stage is the next thing).
    with pytest.raises(AssertionError, match="the engine stage was reached"):
        cli.main(["eval", *argv, "set.add.reward=synthetic"])


def test_a_sets_file_gives_sets_and_options_as_the_command_line_does(no_engine, capsys, hf_dir, prompts, tmp_path):
    sets = tmp_path / "sets.yaml"
    sets.write_text(f"add: {{path: {prompts}, n: 2, temprature: 0.5}}\n")
    err = refused(capsys, "--ckpt", str(hf_dir), "--sets", str(sets), "--out", str(tmp_path / "out"))
    assert "set 'add': unknown option 'temprature'" in err
    sets.write_text(f"add: {{path: {prompts}, n: 2}}\n")
    err = refused(capsys, "--ckpt", str(hf_dir), "--sets", str(sets), "--k", "4", "--out", str(tmp_path / "out"))
    assert "--k 4 is more than n=2" in err  # the file's n, checked as set.add.n=2 would be


def test_each_sets_own_n_and_k_reach_the_engine_stage(monkeypatch, hf_dir, prompts, tmp_path):
    """Not a refusal: a sets file's set with n and k of its own, and a --set with the command's --n
    and --k, pass the checks; the engine stage gets each set's own (the report's per-set ks)."""
    plans = []
    monkeypatch.setattr(command, "evaluate", plans.append)  # returns None: as on a rank that is not the driver
    sets = tmp_path / "sets.yaml"
    sets.write_text(f"quick: {{path: {prompts}, n: 1, k: [1]}}\n")
    assert cli.main(["eval", "--ckpt", str(hf_dir), "--sets", str(sets), "--set", f"add={prompts}", "--n", "4",
                     "--k", "1,4", "--out", str(tmp_path / "out")]) == 0
    (plan,) = plans
    assert [(s.loaded.spec.name, s.loaded.spec.n) for s in plan.sets] == [("add", 4), ("quick", 1)]
    assert plan.ks == {"add": [1, 4], "quick": [1]}


def heldout_records(*overrides: str) -> list:
    """The held-out records training measures eval/accuracy on, for the tiny default with `overrides`."""
    from megatron_rl.config import load_config
    from megatron_rl.data import load_datasets

    return list(load_datasets(load_config(None, list(overrides)).data)[1])


def test_heldout_is_the_checkpoints_runs_held_out_set_or_the_configs(monkeypatch, hf_dir, tmp_path):
    """`--set held=heldout`: a run's checkpoint gets its run's held-out set (its recorded data
    section: 3 prompts of the synthetic task), a Hugging Face directory the tiny default's."""
    plans = []
    monkeypatch.setattr(command, "evaluate", plans.append)  # the checked plan, and no engine
    run = stand_in_run(tmp_path, json.dumps({"step": 1, "config": {"data": {"num_heldout": 3}}}))
    for ckpt in (run, hf_dir):
        assert cli.main(["eval", "--ckpt", str(ckpt), "--set", "held=heldout", "--prompts", "5",
                         "--out", str(tmp_path / "out")]) == 0
    from_run, from_default = (plan.sets[0].loaded for plan in plans)
    assert from_run.records == heldout_records("data.num_heldout=3")
    assert from_default.records == heldout_records()[:5] and len(from_default.records) == 5
    assert from_default.source.startswith("synthetic task 'add' (heldout split")


def test_checkpoints_whose_runs_have_different_held_out_sets_are_refused_for_heldout(no_engine, capsys, hf_dir,
                                                                                   tmp_path):
    run = stand_in_run(tmp_path, json.dumps({"step": 1, "config": {"data": {"num_heldout": 3}}}))
    err = refused(capsys, "--ckpt", str(run), "--ckpt", str(hf_dir), "--set", "held=heldout",
                  "--out", str(tmp_path / "out"))
    assert "set 'held': 'heldout' names each checkpoint's run's held-out set" in err
    assert f"--ckpt {run} (synthetic task 'add' (heldout split, seed 0), 3 prompts)" in err
    assert f"--ckpt {hf_dir}" in err and "have different ones" in err


def test_heldout_takes_no_reading_option(no_engine, capsys, hf_dir, tmp_path):
    err = refused(capsys, "--ckpt", str(hf_dir), "--set", "held=heldout", "set.held.prompt_key=question",
                  "--out", str(tmp_path / "out"))
    assert "set 'held': 'heldout' is the run's held-out set" in err and "set.held.prompt_key does not apply" in err
