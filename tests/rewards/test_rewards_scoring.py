"""Batch scoring: weights, per-sample isolation of errors, hard timeouts, worker replacement."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_rl.errors import ConfigError
from megatron_rl.rewards.config import RewardConfig, build_scorer
from megatron_rl.rewards.math_answer import math_verify_available
from megatron_rl.rewards.scoring import RewardInput, RewardScorer, RewardTerm
from megatron_rl.rewards.synthetic import make_task

TIMEOUT_S = 0.5


def inputs(*responses, answer="5", **metadata):
    return [RewardInput("q", response, answer, metadata) for response in responses]


def test_inline_builtins_never_start_a_process():
    records = make_task(task="add").generate(20, seed=0, split="train")
    samples = [RewardInput(r["prompt"], r["target"] if i % 2 else "0", r["answer"],
                           {k: r[k] for k in ("task", "response_format", "target")}) for i, r in enumerate(records)]
    with RewardScorer([RewardTerm("synthetic"), RewardTerm("synthetic:add", weight=0.5)]) as scorer:
        result = scorer.score(samples)
        assert scorer.pool.workers == []
    want = [0.0 if i % 2 == 0 else 1.5 for i in range(20)]
    want[0] = 1.5 * (records[0]["answer"] == "0")
    assert result.rewards == want
    assert result.errors == result.timeouts == 0 and result.first_error is None


def test_weighted_terms_and_metrics():
    terms = [RewardTerm("math"), RewardTerm("format", weight=0.1), RewardTerm("reward_fixtures:scaled_length",
                                                                              weight=2.0, params={"scale": 0.5})]
    with RewardScorer(terms, timeout_s=5, num_workers=1) as scorer:
        result = scorer.score(inputs(r"\boxed{5}", "Answer: 5", "4"))
    assert result.per_term["math"] == [1.0, 1.0, 0.0]
    assert result.per_term["format"] == [1.0, 0.0, 0.0]
    assert result.per_term["reward_fixtures:scaled_length"] == [4.5, 4.5, 0.5]
    assert result.rewards == pytest.approx([1 + 0.1 + 9.0, 1 + 9.0, 1.0])
    metrics = result.metrics()
    assert metrics["reward/math/mean"] == pytest.approx(2 / 3)
    assert metrics["reward/errors"] == 0 and metrics["reward/timeouts"] == 0


@pytest.mark.skipif(not math_verify_available(), reason="math-verify is not installed")
def test_math_fast_path_decides_inline_and_sympy_runs_in_a_worker():
    with RewardScorer([RewardTerm("math")], timeout_s=10, num_workers=1) as scorer:
        result = scorer.score(inputs(r"\boxed{0.5}", "1,000", answer="1/2"))
        assert result.rewards == [1.0, 0.0] and scorer.pool.workers == []
        result = scorer.score([RewardInput("q", r"\boxed{\sqrt{2}}", r"\sqrt 2")])
        assert len(scorer.pool.workers) == 1
    assert result.rewards == [1.0]


def test_raising_function_scores_zero_and_is_counted():
    with RewardScorer([RewardTerm("reward_fixtures:raise_on_request")], timeout_s=5) as scorer:
        result = scorer.score(inputs("ok", "raise", "ok", "raise"))
    assert result.rewards == [1.0, 0.0, 1.0, 0.0]
    assert result.errors == 2 and result.timeouts == 0
    assert "sample 1" in result.first_error and "ZeroDivisionError: asked to fail" in result.first_error
    assert result.metrics()["reward/reward_fixtures:raise_on_request/errors"] == 2


def test_inline_exceptions_are_isolated_too():
    with RewardScorer([RewardTerm("synthetic")]) as scorer:  # no task metadata: the verifier raises
        result = scorer.score(inputs("5", "6"))
    assert result.rewards == [0.0, 0.0] and result.errors == 2
    assert "needs records with 'task'" in result.first_error


def test_hanging_function_times_out_and_the_scorer_keeps_working():
    with RewardScorer([RewardTerm("reward_fixtures:hang_on_request")], timeout_s=TIMEOUT_S, num_workers=2) as scorer:
        scorer.score(inputs("warm-up"))  # worker start-up is not part of what is timed below
        start = time.monotonic()
        result = scorer.score(inputs("a", "hang", "b", "c", "hang", "d"))
        elapsed = time.monotonic() - start
        assert result.rewards == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
        assert result.timeouts == 2 and result.errors == 0
        assert "no result within 0.5 s" in result.first_error
        # Two workers, two hangs: each hang costs one timeout plus a replacement start, not more.
        assert elapsed < 4 * TIMEOUT_S + 2.0
        hung = [w for w in scorer.pool.workers if w.call is not None]
        assert not hung and scorer.pool.restarts == 2
        processes = [w.process for w in scorer.pool.workers]
        assert all(p.is_alive() for p in processes)
        again = scorer.score(inputs("e", "f"))
        assert again.rewards == [1.0, 1.0] and again.timeouts == 0
    assert not any(p.is_alive() for p in processes)  # close() stops every worker


def test_killed_hung_workers_do_not_linger():
    with RewardScorer([RewardTerm("reward_fixtures:hang_on_request")], timeout_s=TIMEOUT_S, num_workers=1) as scorer:
        scorer.score(inputs("warm-up"))
        first = scorer.pool.workers[0].process
        scorer.score(inputs("hang"))
        assert not first.is_alive() and first.exitcode is not None
        assert scorer.pool.workers[0].process is not first


def test_crashing_worker_counts_as_error_and_is_replaced():
    with RewardScorer([RewardTerm("reward_fixtures:exit_process")], timeout_s=5, num_workers=1) as scorer:
        result = scorer.score(inputs("a", "b"))
    assert result.rewards == [0.0, 0.0] and result.errors == 2
    assert "died (exit code 7)" in result.first_error


HUGE = "beyond the largest reward magnitude 1e+30: the group's mean and variance of such rewards overflow"


@pytest.mark.parametrize("name, params, message", [
    ("reward_fixtures:returns_text", {}, "returned '1.0' (str)"),
    ("reward_fixtures:returns_nan", {}, "returned nan"),
    ("reward_fixtures:returns_huge", {}, f"returned 1e+308, {HUGE}"),
    ("reward_fixtures:returns_huge", {"sign": -1.0}, f"returned -1e+308, {HUGE}"),
])
def test_non_numeric_or_overflowing_rewards_are_errors(name, params, message):
    """Each counts as an error of its sample (scored 0): when every call fails, the run stops with
    this message (train/reward_failures.py), as for NaN."""
    with RewardScorer([RewardTerm(name, params=params)], timeout_s=5, num_workers=1) as scorer:
        result = scorer.score(inputs("a"))
    assert result.rewards == [0.0] and result.errors == 1 and message in result.first_error, result.first_error


def test_unpicklable_metadata_is_an_error_for_that_sample_only():
    samples = [RewardInput("q", "5", "5", {"handle": lambda: None}), RewardInput("q", "5", "5")]
    with RewardScorer([RewardTerm("reward_fixtures:exact")], timeout_s=5, num_workers=1) as scorer:
        result = scorer.score(samples)
    assert result.rewards == [0.0, 1.0] and result.errors == 1
    assert "cannot be sent to a worker" in result.first_error


def test_results_do_not_depend_on_workers():
    samples = inputs(*[str(i) for i in range(12)], answer="3")
    results = []
    for workers in (1, 3):
        with RewardScorer([RewardTerm("reward_fixtures:exact")], timeout_s=5, num_workers=workers) as scorer:
            results.append(scorer.score(samples).rewards)
    assert results[0] == results[1] == [float(i == 3) for i in range(12)]


def test_user_function_in_a_file_runs_in_workers(tmp_path, monkeypatch):
    (tmp_path / "file_reward.py").write_text("def score(prompt, response, answer, **kw):\n    return 0.75\n")
    monkeypatch.chdir(tmp_path)  # a relative path is resolved where the config is read
    with RewardScorer([RewardTerm("file_reward.py:score")], timeout_s=5, num_workers=1) as scorer:
        monkeypatch.chdir("/")
        assert scorer.score(inputs("a")).rewards == [0.75]


def test_scorer_errors():
    with pytest.raises(ConfigError, match=r"rewards.terms\[1\]: reward 'no_such_mod:f': no module named"):
        RewardScorer([RewardTerm("math"), RewardTerm("no_such_mod:f")])
    with pytest.raises(ConfigError, match="isolation='inline' is only allowed"):
        RewardScorer([RewardTerm("reward_fixtures:exact", isolation="inline")])
    if math_verify_available():  # sympy can hang; without it the math check is pure Python
        with pytest.raises(ConfigError, match="isolation='inline' is only allowed"):
            RewardScorer([RewardTerm("math", isolation="inline")])
    with pytest.raises(ConfigError, match="two terms are named 'math'"):
        RewardScorer([RewardTerm("math"), RewardTerm("math", params={"require_boxed": True})])
    with pytest.raises(ConfigError, match="timeout_s"):
        RewardScorer([RewardTerm("math")], timeout_s=0)
    with pytest.raises(ConfigError, match="at least one"):
        RewardScorer([])


def test_forced_process_isolation_for_a_builtin():
    with RewardScorer([RewardTerm("synthetic:add", isolation="process")], timeout_s=5, num_workers=1) as scorer:
        assert scorer.score(inputs("5", "6")).rewards == [1.0, 0.0]
        assert len(scorer.pool.workers) == 1


def test_reward_config_from_dict():
    config = RewardConfig.from_dict({"timeout_s": 3, "terms": ["math", {"name": "format", "weight": 0.1,
                                                                         "params": {"value": 0.5}}]})
    assert [t.name for t in config.terms] == ["math", "format"] and config.terms[1].params == {"value": 0.5}
    with build_scorer(config) as scorer:
        assert scorer.score(inputs(r"\boxed{5}")).rewards == [1.05]
    assert RewardConfig().terms[0].name == "synthetic"


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"timeout": 3}, r"unknown key 'rewards.timeout'; did you mean 'timeout_s'\?"),
        ({"terms": "math"}, r"rewards.terms must be a list"),
        ({"terms": [{"weight": 1}]}, r"rewards.terms\[0\].name is required"),
        ({"terms": ["math", {"name": "format", "wieght": 1}]}, r"unknown key 'rewards.terms\[1\].wieght'"),
        ({"terms": [{"name": "math", "weight": "high"}]}, r"rewards.terms\[0\].weight must be a finite number"),
        ({"terms": [{"name": "math", "params": [1]}]}, r"rewards.terms\[0\].params must be a mapping"),
        ({"terms": [{"name": "math", "isolation": "thread"}]}, r"rewards.terms\[0\].isolation must be one of"),
        ({"terms": []}, r"rewards.terms must list at least one"),
        ({"num_workers": 0}, r"rewards.num_workers must be an integer >= 1"),
    ],
)
def test_reward_config_errors_name_the_key(raw, message):
    with pytest.raises(ConfigError, match=message):
        RewardConfig.from_dict(raw)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie no longer runs
    except FileNotFoundError:
        return False


def _cpu_ticks(pid: int) -> int:
    """User + system CPU time of the process, in clock ticks (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_hung_worker_exits_when_the_trainer_dies():
    script = textwrap.dedent(
        """
        import sys
        from megatron_rl.rewards.scoring import RewardInput, RewardScorer, RewardTerm
        scorer = RewardScorer([RewardTerm("reward_fixtures:hang_on_request")], timeout_s=600, num_workers=1)
        scorer.score([RewardInput("q", "warm-up", "a")])
        print(scorer.pool.workers[0].process.pid, flush=True)
        scorer.score([RewardInput("q", "hang", "a")])
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True)
    try:
        worker_pid = int(trainer.stdout.readline())
        # Wait for the worker to be spinning in the hung function (its CPU time grows), not a
        # fixed time: the kill below must find it there.
        start, deadline = _cpu_ticks(worker_pid), time.monotonic() + 60
        while _cpu_ticks(worker_pid) < start + 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _cpu_ticks(worker_pid) >= start + 5, "the reward worker never started spinning"
        assert _running(worker_pid)
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 10
    while _running(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(worker_pid)
