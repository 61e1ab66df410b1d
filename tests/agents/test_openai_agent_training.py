"""An OpenAI-client agent trained unchanged, end to end with the real parts: `megatron-rl train
--config configs/tiny_agent.yaml rollout.agent=...` (Megatron-Core policy, vLLM CPU engine, the
rollout's chat-completions endpoint, the real OpenAI client).

The agent (tests/agents/openai_test_agents.py `extends_then_rewrites`) makes a call, a second
that extends the first with a user message, and on half of the prompts a third from a rewritten
history, so the steps train on one- and two-segment trajectories whatever the model writes (no
warm start needed: the calculator agent's learning run is benchmarks/agentic.py --openai). At the
first step and after a weight push, the trainer's logprob (Megatron, R3 replaying the engine's
routes) equals the engine's on every model token of every call within 1e-4; the rewritten
histories are counted as new segments, and their tokens are scored too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _support.processes import REPO, child_env, cli_command

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[rollout-cpu])")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))

from run_records import metrics  # noqa: E402
from test_agent_training import SHORT  # noqa: E402

pytestmark = pytest.mark.engine


def test_openai_client_agent_trains_on_the_engines_exact_tokens(tmp_path):
    out = tmp_path / "run"
    command = cli_command("train", "--config", str(REPO / "configs/tiny_agent.yaml"), "--output-dir", str(out),
                          *SHORT, "warm_start.steps=0",
                          "rollout.agent=openai_test_agents:extends_then_rewrites",
                          "rl.routing_replay=rollout", preloaded=True)
    env = child_env(PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests" / "agents")]))
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    steps = metrics(out)
    for step in (1, 2):
        record = steps[step]
        assert record["agent/failed"] == 0 and record["rollout/groups_kept"] == 4, record
        assert record["agent/turns_mean"] > 2.2 and record["agent/info/calls"] == record["agent/turns_mean"]
        assert 0.2 < record["agent/info/new_segments"] < 0.8  # the rewritten histories, each counted
        assert record["agent/masked_token_share"] > 0.02  # "again": an observation inside the sequence
        assert record["mismatch/logp_abs_diff_max"] <= 1e-4, (step, record["mismatch/logp_abs_diff_max"])
        # every token the engine sampled, in every segment, was trained and scored
        assert record["count/tokens"] == round(16 * record["agent/info/sampled_tokens"]), record
        turns = sum(record.get(f"mismatch/turn_{k}/tokens", 0) for k in (1, 2, 3))
        assert record["count/tokens"] == turns and record["mismatch/turn_2/tokens"] > 0
