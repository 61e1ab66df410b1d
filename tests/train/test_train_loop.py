"""The RL loop end to end with the real parts: Megatron-Core policy, vLLM (CPU build) rollouts,
the built-in synthetic task, checkpoints on disk, run through the `megatron-rl train` CLI.

- exact resume: a run stopped by SIGTERM and resumed logs the same metrics (every key except
  wall-clock times) for the steps after its checkpoint as an uninterrupted run, bit for bit,
  rl.eval's pass@k rows (every 3 steps, on the held-out set and a code set in the sandbox) included;
- a reward function that raises or hangs scores 0 for those samples, is counted, and the run
  completes (its last checkpoint written synchronously);
- MoE routing replay and the routing-drift metric with several updates per rollout;
- a misspelled key or an impossible layout fails in under a second, naming the key.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from _support.processes import REPO, child_env, children_cpu_seconds, cli_command, python_command

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[rollout-cpu])")

from run_records import comparable, metrics  # noqa: E402

pytestmark = pytest.mark.engine

# Small enough for CI: 30 warm-start steps, then 5 RL steps of 8 prompts x 4 samples.
SHORT = ["rl.steps=5", "rl.prompts_per_step=8", "rl.group_size=4", "rl.max_response_tokens=6",
         "warm_start.steps=30", "data.num_heldout=16", "rl.eval_every=2", "checkpoint.every_steps=2",
         "logging.wandb_mode=disabled"]


def command(out: Path, *overrides: str, preloaded: bool = False) -> list[str]:
    return cli_command("train", "--output-dir", str(out), *SHORT, *overrides, preloaded=preloaded)


def run(out: Path, *overrides: str, config: Path | None = None) -> subprocess.CompletedProcess:
    cmd = cli_command("train", "--output-dir", str(out), *SHORT, *overrides, *(["--config", str(config)] if config else []),
                      preloaded=True)
    result = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def stop_with_sigterm(out: Path, *overrides: str, after_step: int, preloaded: bool = False) -> str:
    """Start a run and send it SIGTERM once it has logged `after_step`; its output (it must exit 0).

    The run stops after the step in progress when the signal lands, usually `after_step` + 1. A
    tiny step takes about 0.3 s, less than this loop may take to see the record and signal on a
    loaded machine, so callers leave several steps of room before the run's end. preloaded: the
    run forked from the pre-imported server (its client passes the SIGTERM on, zygote.py), for a
    test whose claim is the stop and resume, not the trainer's own process (this module's keeps one)."""
    process = subprocess.Popen(command(out, *overrides, preloaded=preloaded), env=child_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None:
        path = out / "metrics.jsonl"
        if path.is_file() and any(json.loads(line)["step"] >= after_step for line in path.read_text().splitlines() if line):
            # the running trainer holds the directory (train/run_lock.py): the fork, when preloaded
            holder = json.loads((out / "run.lock").read_text())["pid"]
            assert holder == process.pid if not preloaded else holder != process.pid and psutil.pid_exists(holder)
            process.send_signal(signal.SIGTERM)
            break
        time.sleep(0.2)
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-4000:]
    assert not (out / "run.lock").exists(), "a run stopped by SIGTERM must release its directory"
    return output


# rl.eval: 4 samples per prompt every 3 steps (the held-out greedy accuracy keeps rl.eval_every=2),
# through the runner `megatron-rl eval` uses, on the held-out set (which this short run's policy
# never solves: pass@k 0) and on a HumanEval-format set scored by code_tests in the sandbox whose
# check() passes a response with an even sum of character codes: about half of any model's
# samples, so pass@1 < pass@2 < pass@4 holds on real samples. Its 4 prompts ask the same.
PARITY = {"prompt": "def f():\n    return '''", "entry_point": "f",
          "test": "'''\n\n\ndef check(candidate):\n    assert sum(map(ord, candidate())) % 2 == 0\n"}
EVAL = ["rl.eval.sets.heldout=heldout", "rl.eval.n=4", "rl.eval.k=[1,2,4]", "rl.eval.every_steps=3"]


def eval_overrides(tmp_path: Path) -> list[str]:
    path = tmp_path / "parity.jsonl"
    path.write_text("".join(json.dumps({**PARITY, "task_id": f"parity/{i}"}) + "\n" for i in range(4)))
    return [*EVAL, f"rl.eval.sets.parity={path}"]


def check_eval_rows(records: dict[int, dict]) -> None:
    """rl.eval's rows at the steps it names, with pass@k's relations: pass@1 is the share of
    correct samples (= avg@4, the mean reward, for 0/1 rewards), pass@k grows with k; the
    held-out greedy accuracy stays on its own steps."""
    assert sorted(s for s, r in records.items() if "eval/heldout/pass@1" in r) == [0, 3, 5]
    assert sorted(s for s, r in records.items() if "eval/parity/pass@1" in r) == [0, 3, 5]
    assert sorted(s for s, r in records.items() if "eval/accuracy" in r) == [0, 2, 4, 5]
    for step in (0, 3, 5):
        row = records[step]
        assert (row["eval/heldout/prompts"], row["eval/parity/prompts"]) == (16, 4)
        for name in ("heldout", "parity"):
            assert row[f"eval/{name}/pass@1"] == pytest.approx(row[f"eval/{name}/avg@4"], abs=1e-12)
            assert 0 <= row[f"eval/{name}/pass@1"] <= row[f"eval/{name}/pass@2"] <= row[f"eval/{name}/pass@4"] <= 1
        assert 0 < row["eval/parity/pass@1"] < row["eval/parity/pass@2"] < row["eval/parity/pass@4"], row


def test_exact_resume_after_sigterm(tmp_path):
    """Also rl.eval (EVAL): its rows, and after the resume the same figures as the uninterrupted run's."""
    evals = eval_overrides(tmp_path)
    whole = tmp_path / "whole"
    run(whole, *evals)
    assert not (whole / "run.lock").exists(), "a finished run must release its directory"
    reference = metrics(whole)
    assert max(reference) == 5 and "eval/accuracy" in reference[0] and "eval/accuracy" in reference[5]
    check_eval_rows(reference)

    interrupted = tmp_path / "interrupted"
    output = stop_with_sigterm(interrupted, *evals, after_step=1)
    state = json.loads((interrupted / "run_state.json").read_text())
    assert state["finished"] is False, state
    stopped_at = state["step"]
    assert 1 <= stopped_at < 5, state  # stopped before the end, however late the signal landed
    assert f"stopped by SIGTERM after step {stopped_at}" in output

    resumed = run(interrupted, *evals)
    assert "resumed from" in resumed.stdout
    after = metrics(interrupted)
    assert sorted(after) == sorted(reference)
    for step in range(stopped_at + 1, 6):
        assert comparable(after[step]) == comparable(reference[step]), f"step {step} differs after resume"
        assert "reward/mean" in comparable(after[step]) and "train/loss" in comparable(after[step])
    # Run time continues across the resume: never decreasing down the file.
    elapsed = [after[step]["elapsed_s"] for step in sorted(after)]
    assert elapsed == sorted(elapsed) and elapsed[stopped_at + 1] > elapsed[stopped_at], elapsed
    # The steps before the checkpoint were not re-run: their records are the interrupted run's own.
    assert json.loads((interrupted / "run_state.json").read_text()) == {"step": 5, "finished": True}


def test_failing_reward_function_is_counted_and_run_completes(tmp_path):
    config = tmp_path / "flaky.yaml"
    config.write_text(
        "rewards:\n"
        "  timeout_s: 0.25\n"  # a hung call costs its timeout; four workers wait out four at once
        "  num_workers: 4\n"
        "  terms:\n"
        f"    - name: {REPO / 'tests' / 'train' / 'flaky_rewards.py'}:raises_on_sevens\n"
    )
    out = tmp_path / "run"
    # The run's one checkpoint (the last step's) written synchronously: that save used to be
    # finalized twice, and every run with checkpoint.async_save=false ended with exit 1
    # ("results_queue should not be empty").
    console = run(out, "rl.steps=2", "checkpoint.every_steps=0", "checkpoint.async_save=false", config=config)
    console = console.stdout + console.stderr
    assert "checkpoint step_000002: " in console and " written synchronously in " in console, console[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000002"
    records = metrics(out)
    errors = sum(r.get("reward/errors", 0) for r in records.values() if r["step"] > 0)
    timeouts = sum(r.get("reward/timeouts", 0) for r in records.values() if r["step"] > 0)
    assert errors > 0, "no sample made the reward function raise; the test would not show anything"
    assert timeouts > 0, "no sample made the reward function hang"
    assert json.loads((out / "run_state.json").read_text())["finished"] is True
    # Said on the console, a line per step with failures, with the first error (not only in metrics.jsonl).
    warned = [line for line in console.splitlines() if "reward calls failed" in line]
    failing_steps = [r["step"] for r in records.values() if r["step"] > 0 and r["reward/errors"] + r["reward/timeouts"]]
    assert len(warned) == len(failing_steps), console[-3000:]
    assert any("this reward function does not like sevens" in line or "timed out" in line for line in warned), warned


# One RL step of two updates, made so that both updates have a real signal: a task the
# warm-started policy solves about half the time (sums of operands in [0, 3]), so the refill
# keeps all 8 groups (4 per update, each with mixed rewards), and a learning rate high enough that
# the first update moves some tokens' top-2 experts (of 4) before the second update runs.
ROUTING = ["rl.steps=1", "rl.updates_per_rollout=2", "rl.prompts_per_step=8", "rl.group_size=4",
           "data.synthetic.max_operand=3", "data.num_heldout=2", "optimizer.lr=1e-2",
           "checkpoint.every_steps=0", "rl.eval_every=0"]

# Runs the CLI in a process whose RouterTrace also counts, per mode, how many (token, layer)
# routes the training forward actually USED differ from the ones recorded in the old-logprob
# forward. The `moe/routing_drift` metric counts the freshly computed routes instead, with or
# without replay (how much replay corrects), so it cannot show that replay forces the recording.
ROUTE_PROBE = r"""
import json, os, sys
from megatron_rl.model import routing

used = {"replay": [0, 0], "compare": [0, 0]}
make_topk = routing.RouterTrace._make_topk

def probed(self, layer, original):
    inner = make_topk(self, layer, original)
    def topk(*args, **kwargs):
        probs, indices = inner(*args, **kwargs)
        if self.mode in used and self._current is not None:
            recorded = self._recorded[self._current][layer]
            same = (indices.sort(dim=-1).values == recorded.sort(dim=-1).values).all(dim=-1)
            used[self.mode][0] += int((~same).sum())
            used[self.mode][1] += same.numel()
        return probs, indices
    return topk

routing.RouterTrace._make_topk = probed
from megatron_rl.cli import main
code = main(sys.argv[1:])
with open(os.environ["ROUTES_USED"], "w") as file:
    json.dump(used, file)
sys.exit(code)
"""


def run_with_route_probe(out: Path, *overrides: str) -> tuple[dict, dict]:
    """(step 1's metrics, {mode: [routes used that differ from the recorded ones, routes used]})."""
    counts = out.parent / f"{out.name}_routes.json"
    args = ["train", "--output-dir", str(out), *SHORT, *overrides]
    result = subprocess.run(python_command("-c", ROUTE_PROBE, *args, preloaded=True), env=child_env(ROUTES_USED=str(counts)),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return metrics(out)[1], json.loads(counts.read_text())


def test_routing_replay_and_drift_metric(tmp_path):
    with ThreadPoolExecutor(2) as pool:  # two single-threaded processes side by side
        runs = [pool.submit(run_with_route_probe, tmp_path / name, *ROUTING, f"rl.routing_replay={flag}")
                for name, flag in (("compare", "false"), ("replay", "true"))]
        (free, free_routes), (replay, replay_routes) = (future.result() for future in runs)

    for record in (free, replay):
        # Both updates train on 4 groups with mixed rewards; the last one's gradient is not zero.
        assert record["train/updates"] == 2 and record["rollout/groups_kept"] == 8, record
        assert record["count/sequences"] == 32 and record["train/grad_norm"] > 0, record
        # The old logprobs of the second mini-batch come from before the first update (which saw
        # ratio exactly 1): its ratio departs from 1.
        assert record["actor/ratio_max"] > 1.05 and record["actor/ratio_min"] < 0.95, record
    # The same samples in both runs: only the routes of the training forward differ.
    for key in ("reward/mean", "count/tokens", "mismatch/logp_abs_diff_mean"):
        assert free[key] == replay[key], key

    # Without replay the second update routes some tokens to other experts than recorded, and the
    # metric counts exactly those routes.
    changed, total = free_routes["compare"]
    assert changed > 0 and free["moe/routing_drift"] == pytest.approx(changed / total), (free_routes, free)
    assert free_routes["replay"] == [0, 0]
    # With replay every route the training forward used is the recorded one ...
    assert replay_routes["replay"] == [0, total] and replay_routes["compare"] == [0, 0], replay_routes
    # ... while the metric still reports the fresh routes' drift (the same weights reach the second
    # update in both runs, the first one running on the recorded weights and routes) ...
    assert replay["moe/routing_drift"] == free["moe/routing_drift"]
    # ... and the different routes give a different update.
    assert replay["train/loss"] != free["train/loss"]
    assert (replay["actor/ratio_min"], replay["actor/ratio_max"]) != (free["actor/ratio_min"], free["actor/ratio_max"])


@pytest.mark.parametrize("override,expected", [
    ("rl.stepz=3", "unknown key 'rl.stepz'; did you mean 'steps'?"),
    ("parallel.tp=3", "num_attention_heads=4 is not divisible by parallel.tp=3"),
    ("parallel.ep=3", "parallel.ep=3 must divide the number of experts (4)"),
])
def test_bad_config_fails_in_under_a_second(tmp_path, override, expected):
    started = children_cpu_seconds()
    result = subprocess.run(cli_command("train", "--output-dir", str(tmp_path), override),
                            env=child_env(), capture_output=True, text=True, timeout=60)
    cpu = children_cpu_seconds() - started
    assert result.returncode == 2
    assert expected in result.stderr, result.stderr
    assert cpu < 1.0, f"took {cpu:.2f} s of CPU"
    assert not any(tmp_path.iterdir()), "a failed config check must not write anything"
