"""rl.eval's sets read and checked before the runtime starts (train/eval_sets.load_eval_sets), each
refusal naming rl.eval.sets.NAME: a path that does not exist, `heldout` in a run without a
held-out set, a set without the field its reward reads, a prompt too long for the engine's
context next to the evaluation's response budget. A HumanEval-format set brings its own reward
(code_tests in the sandbox); `heldout` is the run's held-out records, cut to rl.eval.prompts. The
refusals name the run's data.* keys, never `megatron-rl eval`'s set.NAME.OPTION."""

from __future__ import annotations

import json

import pytest

from megatron_rl.config import load_config
from megatron_rl.data import load_datasets
from megatron_rl.errors import ConfigError
from megatron_rl.train.eval_sets import load_eval_sets

HUMANEVAL_ROW = {"task_id": "t/0", "prompt": "def f(x):\n", "test": "def check(c):\n    assert c(1) == 2\n",
                 "entry_point": "f"}


def loaded(*overrides: str):
    """rl.eval's sets as the trainer reads them: with the held-out dataset preflight read."""
    config = load_config(None, ["data.num_heldout=16", *overrides])
    return load_eval_sets(config, load_datasets(config.data)[1])


def test_heldout_and_a_humaneval_set_are_read_with_their_rewards(tmp_path):
    path = tmp_path / "he.jsonl"
    path.write_text(json.dumps(HUMANEVAL_ROW) + "\n")
    heldout, humaneval = loaded("rl.eval.sets.heldout=heldout", f"rl.eval.sets.he={path}", "rl.eval.prompts=5")
    assert (heldout.name, len(heldout.records), heldout.rewards) == ("heldout", 5, None)  # the run's rewards
    # The held-out set training measures eval/accuracy on (load_datasets' second), its first rl.eval.prompts.
    expected = load_datasets(load_config(None, ["data.num_heldout=16"]).data)[1]
    assert heldout.records == list(expected)[:5] and heldout.path == expected.source
    assert humaneval.records[0].metadata["entry_point"] == "f"
    assert [term.name for term in humaneval.rewards.terms] == ["code_tests"]


def test_bad_sets_are_refused_naming_the_set(tmp_path):
    with pytest.raises(ConfigError, match=r"rl\.eval\.sets\.x: .*nope\.jsonl does not exist"):
        loaded("rl.eval.sets.x=nope.jsonl")
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(ConfigError, match=r"rl\.eval\.sets\.plain: the reward code_tests reads each record's 'tests'"):
        loaded(f"rl.eval.sets.plain={plain}", "rewards.terms=[{name: code_tests}]")
    long_prompt = tmp_path / "long.jsonl"
    long_prompt.write_text(json.dumps({"prompt": "1+1=" * 300, "answer": "2"}) + "\n")
    with pytest.raises(ConfigError, match=r"rl\.eval\.sets\.long: .*long\.jsonl line 1: the prompt is 1201 tokens "
                                          r"\(raw format\), over the limit of 1014 \(rollout\.max_model_len=1024 - "
                                          r"a response budget of 10\)"):
        loaded(f"rl.eval.sets.long={long_prompt}", "rl.eval.max_tokens=10")


def test_heldout_without_a_heldout_set_is_refused(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    config = load_config(None, [f"data.train={train}", "rl.eval.sets.heldout=heldout"])
    with pytest.raises(ConfigError, match=r"rl\.eval\.sets\.heldout: 'heldout' names the run's held-out set, and "
                                          r"this run has none"):
        load_eval_sets(config, load_datasets(config.data)[1])


def test_the_held_out_file_is_read_once_for_training_and_its_heldout_set(tmp_path, monkeypatch):
    """The trainer's startup reads the held-out file in preflight (data.load_datasets) and hands the
    dataset to load_eval_sets: the set `heldout` is those records, cut to rl.eval.prompts, and the
    file is not read a second time (data.load_source, the one reader of a prompt file, counts)."""
    import megatron_rl.data.prompts as prompts

    path = tmp_path / "heldout.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(6)))
    config = load_config(None, [f"data.heldout={path}", "rl.eval.sets.held=heldout", "rl.eval.prompts=4"])
    reads, read = [], prompts.load_source
    monkeypatch.setattr(prompts, "load_source", lambda data, key: reads.append(key) or read(data, key))
    _, heldout = load_datasets(config.data)  # preflight's read
    (held,) = load_eval_sets(config, heldout)
    assert reads == ["heldout"]  # the synthetic train set reads no file
    assert held.records == list(heldout)[:4] and len(heldout) == 6 and held.path == str(path)


def test_a_missing_field_is_named_with_the_runs_data_key_not_a_set_option(tmp_path):
    """rl.eval's sets have no per-set options: the fix is the run's data.* key, in rl.eval's words."""
    path = tmp_path / "questions.jsonl"
    path.write_text(json.dumps({"question": "1+2=", "answer": "3"}) + "\n")
    with pytest.raises(ConfigError) as refused:
        loaded(f"rl.eval.sets.q={path}")
    message = str(refused.value)
    assert message.startswith("rl.eval.sets.q: ") and "prompt key 'prompt'" in message
    assert "data.prompt_key=FIELD" in message and "set.q." not in message and "set 'q'" not in message
    with pytest.raises(ConfigError, match=r"rl\.eval\.sets\.code: .*map the field that holds the tests with "
                                          r"data\.columns\.FIELD=tests"):
        loaded(f"rl.eval.sets.code={tmp_path / 'questions.jsonl'}", "data.prompt_key=question",
               "rewards.terms=[{name: code_tests}]")


def test_a_humaneval_set_on_a_machine_without_the_sandbox_is_refused_before_any_model(tmp_path, monkeypatch):
    """Its code_tests reward is resolved with the set: where the namespace sandbox cannot be built,
    the run stops here (not after the model and engines are up), naming a way out that reaches the
    set's reward (rl.eval's sets have no reward params; the run's rewards.terms[].params do not
    score it): the command's per-set option, after training."""
    import megatron_rl.sandbox

    path = tmp_path / "he.jsonl"
    path.write_text(json.dumps(HUMANEVAL_ROW) + "\n")
    monkeypatch.setattr(megatron_rl.sandbox, "namespaces_available", lambda: "no user namespaces here (a test)")
    with pytest.raises(ConfigError) as refused:
        loaded(f"rl.eval.sets.he={path}")
    message = str(refused.value)
    assert message.startswith("rl.eval.sets.he: its reward code_tests runs the model's programs in a namespace "
                              "sandbox, which this machine cannot build: no user namespaces here (a test)")
    assert message.endswith(f"take the set out of rl.eval.sets and evaluate the run's checkpoints on it with "
                            f"`megatron-rl eval --ckpt RUN --set he={path} set.he.reward_params.isolation=none`")
    assert "params: {isolation: none}" not in message
