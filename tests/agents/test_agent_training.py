"""Multi-turn RL end to end with the real parts: `megatron-rl train --config configs/tiny_agent.yaml`
(Megatron-Core policy, vLLM CPU rollouts, the built-in calculator tool over several turns), short,
both runs from one warm start (`megatron-rl sft` on the recipe's demonstrations, made once).

- colocated, with R3 (the engine's MoE routes replayed in the trainer; the last turn's request
  routed every token of the trajectory, observations included): every step trains on multi-turn
  trajectories (observation tokens a real share of the sequence, turns > 1); the trainer's logprob
  (Megatron, recomputed with two updates per rollout) equals the engine's on every model token of
  every turn within 1e-4, at the first step and after each weight push
  (`mismatch/logp_abs_diff_max` is the max over all scored tokens; the per-turn keys say each
  turn was scored);
- asynchronous (rollout.mode=server, rl.max_staleness=1) on the shared server: multi-turn groups
  come through the producer, tokens one version stale after the first step;
- the asynchronous checkpoint's batches keep their multi-turn masks and agent records.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from _support.processes import REPO, child_env, cli_command

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[rollout-cpu])")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))

from run_records import metrics  # noqa: E402

pytestmark = pytest.mark.engine

CONFIG = REPO / "configs/tiny_agent.yaml"
# every demonstration calls the tool, so 40 warm-start steps of 16 make a model that calls it (measured
# at the first RL steps: tool-call rate 0.44-0.63, turns 1.44-1.63; the tests ask > 0.25 and > 1.1)
DATA = ["data.synthetic.tool_demonstrations=1.0", "data.num_heldout=8"]
# dr_grpo: no dynamic sampling, so the few steps train on every group whatever the rewards
SHORT = ["rl.recipe=dr_grpo", "rl.steps=2", "rl.prompts_per_step=4", "rl.group_size=4", *DATA, "rl.eval_every=0",
         "checkpoint.every_steps=0", "checkpoint.export_hf=false", "logging.wandb_mode=disabled"]


def cli(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run(cli_command(*args, preloaded=True), env=child_env(), capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory) -> Path:
    """The multi-turn warm start, made once for both runs: `megatron-rl sft` on the recipe's
    demonstrations; `train checkpoint.init_from=DIR warm_start.steps=0` starts from exactly its
    weights (tests/train/test_sft.py)."""
    out = tmp_path_factory.mktemp("agent") / "sft"
    cli("sft", "--config", str(CONFIG), "--output-dir", str(out), "warm_start.steps=40", "warm_start.batch_size=16", *DATA)
    return out


def train(out: Path, warm: Path, *overrides: str):
    cli("train", "--config", str(CONFIG), "--output-dir", str(out), *SHORT, f"checkpoint.init_from={warm}",
        "warm_start.steps=0", *overrides)
    return metrics(out)


def test_colocated_multi_turn_steps_match_the_engine_on_every_model_token(warm_start, tmp_path):
    steps = train(tmp_path / "run", warm_start, "rl.routing_replay=rollout")
    for step in (1, 2):
        record = steps[step]
        assert record["agent/turns_mean"] > 1.1 and record["agent/tool_call_rate"] > 0.25, record
        assert 0.1 < record["agent/masked_token_share"] < 0.9
        assert record["agent/failed"] == 0 and record["rollout/groups_kept"] == 4
        # trainer vs engine, every scored (model) token: max and per turn
        assert record["mismatch/logp_abs_diff_max"] <= 1e-4, (step, record["mismatch/logp_abs_diff_max"])
        assert record["mismatch/turn_1/tokens"] > 0 and record["mismatch/turn_2/tokens"] > 0
        assert record["mismatch/turn_1/logp_abs_diff_mean"] <= 1e-5
        # only the model's tokens are counted: observations are a real share, yet out of the count
        assert record["count/tokens"] == sum(record[f"mismatch/turn_{k}/tokens"] for k in (1, 2, 3))
    assert "eval/tool_call_rate" in steps[2] and steps[2]["eval/turns_mean"] >= 1


def test_asynchronous_server_multi_turn(tiny_vllm_server, warm_start, tmp_path):
    url = tiny_vllm_server[0]
    steps = train(tmp_path / "async", warm_start, "rollout.mode=server", f"rollout.server_urls=[{url}]",
                  "rollout.weight_transport=files", f"rollout.staging_dir={tmp_path / 'staging'}",
                  "rl.max_staleness=1")
    assert steps[1]["rollout/staleness_max"] == 0 and steps[2]["rollout/staleness_max"] == 1
    for step in (1, 2):
        assert steps[step]["agent/turns_mean"] > 1.1 and steps[step]["agent/masked_token_share"] > 0.1
        assert steps[step]["count/tokens"] == sum(steps[step][f"mismatch/turn_{k}/tokens"] for k in (1, 2, 3))
    assert steps[1]["mismatch/staleness_0/logp_abs_diff_mean"] < 1e-4


def test_async_checkpoint_keeps_multi_turn_trajectories():
    from megatron_rl.train.async_rollout import Batch, _batch_from_json, _batch_to_json
    from megatron_rl.train.experience import Trajectory

    t = Trajectory(0, [1, 2], [5, 6, 7, 8], [-0.1, 0.0, 0.0, -0.2], False, 1.0, versions=[3, 3, 3, 4],
                   loss_mask=[1, 0, 0, 1], agent={"turns": 2, "finish": "stop", "status": "ok", "reward": 1.0,
                                                   "info": {"tool_calls": 1.0}, "env_time_s": 0.1, "error": None,
                                                   "model_tokens": 2})
    group = [t]
    batch = Batch(4, [group], [group], [(1, {})], [9])
    (restored,), = _batch_from_json(_batch_to_json(batch)).groups
    assert restored.loss_mask == t.loss_mask and restored.agent == t.agent and restored.versions == t.versions
    assert restored.turn_index().tolist() == [1, 0, 0, 2]
