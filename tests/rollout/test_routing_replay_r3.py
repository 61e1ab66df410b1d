"""R3 (rollout routing replay, `rl.routing_replay: rollout`) against a real vLLM engine (CPU build).

The engine's routes are captured inside vLLM (megatron_rl/rollout/worker/route_capture.py) and replayed
by the trainer (megatron_rl/model/routing.py). On a tiny Qwen3-MoE whose MoE layers are its
second and third (so routers map to MoE layers by their global layer number), see r3_worker.py:
- every sample carries [prompt + response - 1, MoE layers, k] routes; a prompt served from the
  prefix cache gets the routes of the forward that computed it;
- with the engine's weights the trainer's own routes agree with the captured ones (>= 98% of
  (token, layer) routes; near-ties in fp32 aside): they are the engine's routing of these tokens;
- with the trainer's routers perturbed its own choice differs on some tokens, yet the R3 logprob
  forward and the R3 training step use the engine's experts on EVERY engine-routed token, and
  the trainer's own on the tokens the engine never ran; the drift counters count exactly the
  differing routes.
And `megatron-rl train rl.routing_replay=rollout` runs a step with old-logprob, reference (KL)
and training forwards on the engine's routes; the setting's spellings and refusals.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _support.processes import REPO, child_env, cli_command, torchrun_command
from megatron_rl.config import load_config

from megatron_rl.errors import ConfigError

WORKER = Path(__file__).with_name("r3_worker.py")
sys.path.insert(0, str(REPO / "tests" / "bridge"))
from test_bridge import family_configs, make_hf_model  # noqa: E402
from vocab_tokenizer import write_tokenizer  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.multiprocess]


def needs_vllm() -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[rollout-cpu])")


def test_r3_replays_the_engines_routes(tmp_path):
    needs_vllm()
    hf = tmp_path / "hf"
    raw = dict(family_configs()["qwen3_moe"], num_hidden_layers=3, mlp_only_layers=[0])
    make_hf_model(raw, hf)
    write_tokenizer(hf, raw["vocab_size"])
    out = tmp_path / "report.json"
    command = torchrun_command(WORKER, 1, "--hf", str(hf), "--out", str(out), preloaded=True)
    result = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-6000:]
    report = json.loads(out.read_text())

    assert report["shapes_ok"] and report["prefix_routes_shared"], report
    assert report["moe_layers"] == [0, 1] and report["microbatches"] > 1, report
    same = report["same_weights"]
    assert same["used_differ"] == same["own_differ"], same  # a recording forward routes by itself
    assert same["total"] > 100 and same["own_differ"] <= 0.02 * same["total"], same

    own = report["perturbed_own"]
    assert own["own_differ"] > 0, "the perturbation left every route as the engine's: the test would show nothing"
    for key, counts in (("r3_logprobs", "rollout_counts"), ("r3_train", "train_counts")):
        used = report[key]
        assert used["total"] == own["total"], (key, used)
        # Without replay these forwards would route some tokens elsewhere than the engine did ...
        assert used["own_differ"] > 0, (key, used)
        # ... with R3 every engine-routed token takes the engine's experts in every MoE layer,
        assert used["used_differ"] == 0, (key, used)
        # the tokens the engine never ran (each sample's last) the forward's own,
        assert used["unrouted"] > 0 and used["unrouted_kept"] == used["unrouted"], (key, used)
        # and the drift counter counts the forward's own choices that differ from the engine's.
        assert report[counts] == [used["own_differ"], used["total"]], (key, report[counts], used)


def test_train_runs_with_rollout_routing_replay(tmp_path):
    """One GRPO step of the built-in tiny default (MoE) with R3: two updates (so an old-logprob
    forward) and a KL reference forward, all on the engine's routes."""
    needs_vllm()
    out = tmp_path / "run"
    command = cli_command("train", "--output-dir", str(out), "rl.routing_replay=rollout", "rl.recipe=grpo",
                          "rl.steps=1", "rl.prompts_per_step=4", "rl.group_size=4", "warm_start.steps=0",
                          "data.num_heldout=2", "rl.eval_every=0", "checkpoint.every_steps=0",
                          "checkpoint.export_hf=false", "logging.wandb_mode=disabled", preloaded=True)
    result = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    step = next(record for record in records if record["step"] == 1)
    assert step["train/updates"] == 2 and "actor/kl" in step, step
    # Trainer and engine hold the same fp32 weights: the trainer's own routes are the engine's.
    assert step["moe/rollout_routing_drift"] <= 0.02 and 0 <= step["moe/routing_drift"] <= 1, step


@pytest.mark.parametrize("value,expected", [("true", "training"), ("false", "off"), ("off", "off"),
                                            ("training", "training"), ("rollout", "rollout")])
def test_routing_replay_spellings(tmp_path, value, expected):
    assert load_config(None, [f"rl.routing_replay={value}"]).rl.routing_replay == expected
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"rl:\n  routing_replay: {value}\n")  # YAML reads a bare off / true as booleans
    assert load_config(recipe).rl.routing_replay == expected


def test_routing_replay_refusals():
    with pytest.raises(ConfigError, match=r"rl.routing_replay: 'always' is not one of 'off', 'training', 'rollout'"):
        load_config(None, ["rl.routing_replay=always"])
    with pytest.raises(ConfigError, match="only the vLLM engines"):
        load_config(None, ["rl.routing_replay=rollout", "rollout.engine=sglang", "rollout.mode=server"])
    from megatron_rl.train.preflight import check_layout_and_paths

    with pytest.raises(ConfigError, match="tiny-qwen3 is a dense model"):
        check_layout_and_paths(load_config(None, ["rl.routing_replay=rollout", "model.hf_config=tiny-qwen3"]))
