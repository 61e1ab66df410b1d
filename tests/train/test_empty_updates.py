"""A step whose groups fill fewer mini-batches than rl.updates_per_rollout (a filter kept one
group, or none) takes an optimizer step per mini-batch with data, and none for the others.

An optimizer step on no data is no no-op: Adam's momentum (and weight decay) move every weight.
Before train/experience.py pack_step left such mini-batches out, a step with one kept group and
two updates ran a second, empty update, and a step with no group ran two: the weights kept
moving in the last direction with nothing to learn from (seen in `megatron-rl train` logs as
train/grad_norm 0 with train/updates 2). The learning-rate schedule still moves on by the
updates a step could not fill, so the rate at each step is the schedule's.

One process, the tiny default with its real Megatron optimizer (run_updates, as the trainer
calls it): a full step, then a step with no group, then a step with one group, each with
rl.updates_per_rollout=2.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from _support.processes import REPO, child_env, python_command

pytestmark = pytest.mark.subprocess

SCRIPT = r"""
import json, sys, torch
from megatron_rl.algorithms.from_config import recipe_for
from megatron_rl.config import load_config
from megatron_rl.model.policy import Policy, _adam_step
from megatron_rl.runtime import start_runtime
from megatron_rl.train.experience import Trajectory, pack_step
from megatron_rl.train.routing_replay import RoutingReplay
from megatron_rl.train.update import LossSettings, run_updates, store_step_logprobs

out = sys.argv[1]
config = load_config(None, ["device=cpu", "rl.updates_per_rollout=2", "optimizer.lr=1e-3",
                            "optimizer.weight_decay=0.1"])
runtime = start_runtime(config)
policy = Policy(config, runtime, total_steps=20)
settings = LossSettings.for_run(config, recipe_for(config.rl))
routing = RoutingReplay.attach(config.rl.routing_replay, policy, runtime)
generator = torch.Generator().manual_seed(0)


def group(index):
    rows = []
    for advantage in (1.5, -0.5, -0.5, -0.5):
        prompt = torch.randint(3, 200, (5,), generator=generator).tolist()
        response = torch.randint(3, 200, (6,), generator=generator).tolist()
        rows.append(Trajectory(index, prompt, response, [0.0] * 6, False, 0.0, advantage=advantage))
    return rows


def weights():
    return torch.cat([p.detach().float().flatten().clone() for p in policy.module.parameters()])


def step(groups):
    experience = pack_step(groups, dp_rank=0, dp_size=1, updates=2, token_budget=64,
                           pad_to_multiple=policy.pad_to_multiple)
    store_step_logprobs(policy, experience, "old_logprobs", None, temperature=1.0)
    metrics = run_updates(policy, runtime, experience, settings, routing, policy_version=0,
                          check=lambda update, result: None)
    return {"updates": metrics["train/updates"], "grad_norm": metrics["train/grad_norm"],
            "sequences": metrics["count/sequences"], "lr": policy.learning_rate,
            "schedule": policy.scheduler.num_steps, "adam_step": _adam_step(policy.optimizer),
            "moved": float((weights() - start).abs().max())}


record = {}
start = weights()
record["full"] = step([group(0), group(1)])
start = weights()
record["none"] = step([])
start = weights()
record["one"] = step([group(0)])
json.dump(record, open(out, "w"))
runtime.shutdown()
"""


def test_updates_without_data_take_no_optimizer_step(tmp_path):
    out = tmp_path / "out.json"
    result = subprocess.run(python_command("-c", SCRIPT, out, preloaded=True), cwd=REPO, env=child_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    got = json.loads(out.read_text())
    full, none, one = got["full"], got["none"], got["one"]
    print(got)
    # A full step: two updates, each with data; Adam now has momentum.
    assert (full["updates"], full["sequences"], full["adam_step"], full["schedule"]) == (2, 8, 2, 2)
    assert full["grad_norm"] > 0 and full["moved"] > 0
    # No group: no update, the weights bit for bit as they were, Adam's step count unchanged; the
    # schedule moved on by the two updates.
    assert (none["updates"], none["sequences"], none["grad_norm"], none["moved"]) == (0, 0, 0.0, 0.0)
    assert (none["adam_step"], none["schedule"]) == (2, 4) and none["lr"] != full["lr"]
    # One group, two updates asked for: one optimizer step (with its gradient), the schedule by two.
    assert (one["updates"], one["sequences"], one["adam_step"], one["schedule"]) == (1, 4, 3, 6)
    assert one["grad_norm"] > 0 and one["moved"] > 0
