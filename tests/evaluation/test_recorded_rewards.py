"""What `megatron-rl eval` takes from the rewards a checkpoint's run recorded
(evaluation/recorded_rewards.py): checked where a set is scored with them, kept exactly as
recorded with --trust-recorded-rewards.

Each case runs the CLI in this process on a stand-in run directory (stand_ins.py). A refusal
stops before the engine stage (conftest's `no_engine`); a case that passes records the plan
`prepare` made, with the engine stage and the two engine-side checks (torch's import, the
tokenizer's prompt lengths: the stand-in has no tokenizer) replaced by `planned`."""

from __future__ import annotations

import json

import pytest

from megatron_rl import cli
from megatron_rl.evaluation import command
from megatron_rl.evaluation.humaneval import humaneval_rewards
from stand_ins import refused, stand_in_run

STATE = "checkpoints/step_000001/trainer_state.json"


@pytest.fixture
def planned(monkeypatch):
    """`megatron-rl eval ARGV` up to its plan, which is returned (the engine stage replaced)."""
    plans = []
    monkeypatch.setattr(command, "evaluate", lambda plan: plans.append(plan))
    monkeypatch.setattr(command, "_check_engine", lambda config: None)
    monkeypatch.setattr(command, "_check_prompt_lengths", lambda sets, configs: None)

    def plan(capsys, *argv: str):
        status = cli.main(["eval", *argv])
        assert status == 0, capsys.readouterr().err
        return plans[-1]

    return plan


@pytest.fixture
def custom_run(tmp_path):
    """A stranger's run whose recorded rewards name a reward file (its import writes `ran`), with
    params and weights, beside math; and that file."""
    reward = tmp_path / "recorded_reward.py"
    reward.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('the checkpoint chose this code')\n\n"
                      "def score(prompt, response, answer, scale=1.0, **metadata):\n    return scale\n")
    terms = [{"name": f"{reward}:score", "weight": 0.25, "params": {"scale": 3.0}},
             {"name": "math", "weight": 0.75, "params": {"require_boxed": True}}]
    return stand_in_run(tmp_path, json.dumps({"step": 1, "config": {"rewards": {"terms": terms}}})), reward


@pytest.fixture
def humaneval(tmp_path):
    path = tmp_path / "he.jsonl"
    row = {"task_id": "t/0", "prompt": "def f(x):\n", "entry_point": "f",
           "test": "def check(c):\n    assert c(1) == 2\n"}
    path.write_text(json.dumps(row) + "\n")
    return path


def test_a_recorded_custom_reward_no_set_uses_is_not_refused(planned, capsys, prompts, humaneval, custom_run,
                                                             tmp_path):
    """Every set scored otherwise (its own reward, the HumanEval format's code_tests): before, the
    recorded custom reward refused the checkpoint all the same. Nothing of it is imported."""
    run, _ = custom_run
    plan = planned(capsys, "--ckpt", str(run), "--set", f"a={prompts}", "--set", f"he={humaneval}",
                   "--out", str(tmp_path / "out"), "set.a.reward=math")
    assert [[term.name for term in s.rewards.terms] for s in plan.sets] == [["math"], ["code_tests"]]
    assert not (tmp_path / "ran").exists()


def test_a_set_scored_with_a_recorded_custom_reward_is_refused_naming_the_trust_flag(no_engine, planned, capsys,
                                                                                     prompts, custom_run, tmp_path):
    """Set b has no reward of its own, so the run's recorded terms would score it: refused by
    set, checkpoint, file and term, naming --trust-recorded-rewards and the set's own way out;
    the reward file is not imported. The command's own rewards.terms is taken as it is."""
    run, reward = custom_run
    err = refused(capsys, "--ckpt", str(run), "--set", f"a={prompts}", "--set", f"b={prompts}",
                  "--out", str(tmp_path / "out"), "set.a.reward=math")
    assert err.rstrip().endswith(
        f"set 'b': --ckpt {run}: the config recorded in {run}/{STATE} names the reward '{reward}:score' "
        "(rewards.terms[0]), code that eval does not run on a checkpoint's say; if you trust the checkpoint, pass "
        "--trust-recorded-rewards (its rewards as recorded), or score the set with a reward of your own: "
        "set.b.reward=NAME"), err
    assert not (tmp_path / "ran").exists()
    yours = [f'rewards.terms=[{{name: "{reward}:score"}}]']  # the command's own terms are the user's word
    plan = planned(capsys, "--ckpt", str(run), "--set", f"b={prompts}", "--out", str(tmp_path / "out"), *yours)
    assert [term.name for term in plan.sets[0].rewards.terms] == [f"{reward}:score"]


def test_trusted_recorded_rewards_score_the_set_exactly_as_recorded(planned, capsys, prompts, custom_run, tmp_path):
    """--trust-recorded-rewards: the set is scored with every recorded term, its params and weight
    (before, the advice was to retype the one refused term, which dropped them and math)."""
    run, reward = custom_run
    plan = planned(capsys, "--ckpt", str(run), "--set", f"a={prompts}", "--out", str(tmp_path / "out"),
                   "--trust-recorded-rewards")
    (scored,) = plan.sets
    assert [(t.name, t.weight, dict(t.params)) for t in scored.rewards.terms] == [
        (f"{reward}:score", 0.25, {"scale": 3.0}), ("math", 0.75, {"require_boxed": True})]
    assert (tmp_path / "ran").exists()  # resolved now, on the user's word
    assert plan.record["sets"][0]["rewards"]["terms"][0]["params"] == {"scale": 3.0}


@pytest.mark.parametrize("terms, named", [
    ('[{"name": "code_tests", "params": {"isolation": "none"}}]',
     "runs code_tests with isolation='none' (rewards.terms[0].params), which would run the model's programs outside "
     "the sandbox; if you trust the checkpoint, pass --trust-recorded-rewards (its rewards as recorded), or score the "
     "set with a reward of your own: set.a.reward=NAME"),
    ('[{"name": "code_tests", "params": {"memory_mb": 1000000}}]',
     "runs code_tests with memory_mb=1e+06 (rewards.terms[0].params), above the 4096 eval takes from a checkpoint; "
     "if you trust the checkpoint, pass --trust-recorded-rewards"),
    ('[{"name": "math"}, {"name": "code_tests", "params": {"wall_seconds": 86400}}]',
     "runs code_tests with wall_seconds=86400 (rewards.terms[1].params), above the 60 eval takes"),
], ids=["isolation", "memory_mb", "wall_seconds"])
def test_recorded_code_tests_run_in_the_sandbox_within_bounds_where_a_set_uses_them(no_engine, planned, capsys,
                                                                                    prompts, tmp_path, terms, named):
    """A stranger's code_tests unsandboxed, or with `memory_mb: 1000000`, would take this machine;
    refused for a set scored with them, not for one with its own reward."""
    run = stand_in_run(tmp_path, '{"step": 1, "config": {"rewards": {"terms": %s}}}' % terms)
    argv = ["--ckpt", str(run), "--set", f"a={prompts}", "--out", str(tmp_path / "out")]
    err = refused(capsys, *argv)
    assert f"set 'a': --ckpt {run}: the config recorded in {run}/{STATE} {named}" in err, err
    assert [t.name for t in planned(capsys, *argv, "set.a.reward=math").sets[0].rewards.terms] == ["math"]


@pytest.mark.parametrize("rewards, named", [
    ('{"timeout_s": 1000000}', "sets rewards.timeout_s=1e+06, above the 600 eval takes from a checkpoint; if you "
                               "mean it, set it yourself: rewards.timeout_s=1e+06, or if you trust the checkpoint, "
                               "pass --trust-recorded-rewards"),
    ('{"num_workers": 10000}', "sets rewards.num_workers=10000, above the 64 eval takes from a checkpoint"),
], ids=["timeout_s", "num_workers"])
def test_recorded_scoring_limits_are_bounded_where_a_set_is_scored_with_them(no_engine, planned, capsys, prompts,
                                                                             humaneval, tmp_path, rewards, named):
    """The run's timeouts and workers score a set with its own reward too: refused there; a
    HumanEval-format set takes none of them and passes. The user's own value, or the flag, is
    taken as it is."""
    run = stand_in_run(tmp_path, '{"step": 1, "config": {"rewards": %s}}' % rewards)
    argv = ["--ckpt", str(run), "--out", str(tmp_path / "out")]
    err = refused(capsys, *argv, "--set", f"a={prompts}", "set.a.reward=math")
    assert f"set 'a': --ckpt {run}: the config recorded in {run}/{STATE} {named}" in err, err
    assert planned(capsys, *argv, "--set", f"he={humaneval}").sets[0].rewards == humaneval_rewards()  # the format's
    yours = planned(capsys, *argv, "--set", f"a={prompts}", "rewards.timeout_s=1000000", "rewards.num_workers=10000")
    assert (yours.sets[0].rewards.timeout_s, yours.sets[0].rewards.num_workers) == (1000000, 10000)
    trusted = planned(capsys, *argv, "--set", f"a={prompts}", "--trust-recorded-rewards").sets[0].rewards
    for key, value in json.loads(rewards).items():
        assert getattr(trusted, key) == value
