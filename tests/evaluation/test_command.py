"""`megatron-rl eval` end to end on the tiny model: one invocation evaluates a checkpoint of every
kind --ckpt accepts, on one prompt set through one engine (the
suite's shared vLLM CPU server, rollout.server_urls), scored by a user reward function.

The checkpoints come from one short real run (its run directory, its training checkpoint, its
Hugging Face export), `megatron-rl convert hf-to-megatron` of that export, and a short LoRA run
(its run directory and its merged export); a second set, `held=heldout`, is the run's own held-out
set. Asserted: every checkpoint got the same prompts with
the same seeds (identical weights give identical outcomes and differences of exactly 0 with
zero-width intervals; the LoRA checkpoint, merged, gives its merged export's), the figures in eval.json equal those
re-derived here in float64 from its outcomes (Chen et al.'s pass@k, avg@n, greedy accuracy), each
sample's correctness is its reward against the threshold, the report's files and the progress
lines are written, and the `heldout` set is the prompts the run's own held-out evaluation saw,
on which the run's checkpoint scores greedy what the run logged at that step (eval/accuracy,
eval/reward_mean, eval/length_mean: the same prompts, greedy, the same weights)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from _support.processes import child_env, cli_command

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[rollout-cpu])")

pytestmark = [pytest.mark.engine, pytest.mark.subprocess]

N = 4
PROMPTS = 6
# Half-random rewards from a user function: the figures are neither all 0 nor all 1.
REWARD = '''
def even_length(prompt, response, answer, **metadata):
    return 1.0 if len(response) % 2 == 0 else 0.0
'''


def cli(*args, timeout=600) -> subprocess.CompletedProcess:
    result = subprocess.run(cli_command(*args, preloaded=True, children=True), env=child_env(), capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, f"{args[:2]} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def pass_at_k(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_every_checkpoint_kind_on_one_engine_gives_the_same_outcomes_and_rederivable_figures(tiny_vllm_server,
                                                                                            tmp_path):
    url = tiny_vllm_server[0]
    served = ["rollout.mode=server", f"rollout.server_urls=[{url}]", "rollout.weight_transport=files",
              f"rollout.staging_dir={tmp_path / 'staging'}"]
    run = tmp_path / "run"
    # A short warm start: this run's policy is far from the LoRA run's (random initialization), so the two
    # give different samples and identical outcomes mean identical weights, pushed.
    cli("train", "--output-dir", str(run), "rl.steps=1", "warm_start.steps=20", "rl.prompts_per_step=2",
        "rl.group_size=2", "rl.max_response_tokens=4", "data.num_heldout=2", "checkpoint.every_steps=1",
        "checkpoint.async_save=false", "logging.wandb_mode=disabled", *served)
    # A LoRA run (adapters moved by one step under a format reward that some samples meet): its checkpoint
    # is built with the run's model.lora and pushed merged, as its own merged export is.
    lora = tmp_path / "lora"
    cli("train", "--output-dir", str(lora), "rl.steps=1", "warm_start.steps=0", "rl.prompts_per_step=2",
        "rl.group_size=8", "rl.max_response_tokens=4", "data.num_heldout=2", "model.lora.rank=8", "model.lora.alpha=16",
        "optimizer.lr=2e-3", "rl.recipe=dr_grpo", "rewards.terms=[{name: format, params: {pattern: '.*[0-9].*'}}]",
        "checkpoint.every_steps=1", "checkpoint.async_save=false", "logging.wandb_mode=disabled", *served)
    converted = tmp_path / "converted"
    cli("convert", "hf-to-megatron", "--hf-dir", str(run / "hf_model"), "--out", str(converted))

    prompts = tmp_path / "add.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b), "task": "add"}) + "\n"
                               for a, b in [(3, 4), (12, 9), (25, 1), (7, 7), (0, 18), (30, 2)]))
    reward = tmp_path / "length_reward.py"
    reward.write_text(REWARD)
    out = tmp_path / "out"
    checkpoints = [run, run / "checkpoints" / "step_000001", converted, run / "hf_model", lora, lora / "hf_model"]
    # held: every checkpoint's run's held-out set (data.num_heldout=2 for the checkpoints no run wrote, the
    # runs' own), scored by the synthetic verifier (the two runs' rewards differ).
    result = cli("eval", *(arg for ckpt in checkpoints for arg in ("--ckpt", str(ckpt))), "--set", f"add={prompts}",
                 "--set", "held=heldout", "--n", str(N), "--temperature", "1.0", "--out", str(out),
                 f"set.add.reward={reward}:even_length", "set.held.reward=synthetic", "data.num_heldout=2", *served)

    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == \
        ["engine_model", "eval.json", "eval.md", "pass_at_k.png"]
    report = json.loads((out / "eval.json").read_text())
    kinds = [entry["kind"] for entry in report["config"]["checkpoints"]]
    assert kinds == ["run directory", "training checkpoint", "converted Megatron checkpoint", "Hugging Face directory",
                     "run directory", "Hugging Face directory"]
    assert [c["step"] for c in report["checkpoints"]] == [1, 1, None, 1, 1, 1]

    # The same prompts and seeds for every checkpoint: identical weights, identical samples.
    outcomes = [c["sets"][0]["outcome"] for c in report["checkpoints"]]
    for outcome in outcomes[1:4]:
        assert outcome["prompts"] == outcomes[0]["prompts"]
    assert outcomes[5]["prompts"] == outcomes[4]["prompts"]  # the LoRA checkpoint merged = its merged export
    assert outcomes[4]["prompts"] != outcomes[0]["prompts"]  # ... and another policy than the first run's
    for difference in report["differences"][:3]:
        for name, figure in difference["sets"][0]["figures"].items():
            assert figure["difference"] == 0.0 and figure["low"] == figure["high"] == 0.0, (difference["b"], name)

    # The figures, re-derived in float64 from the outcomes alone.
    prompts_out = outcomes[0]["prompts"]
    assert [p["index"] for p in prompts_out] == list(range(PROMPTS))
    samples = [s for p in prompts_out for s in p["samples"]]
    assert all(len(p["samples"]) == N and p["greedy"] is not None for p in prompts_out)
    assert all(s["correct"] == (s["reward"] >= 0.5) and s["reward"] == (len(s["text"]) % 2 == 0)
               for s in samples if s["text"])  # the texts kept (the first prompts) are scored as the function says
    rewards = [s["reward"] for s in samples]
    assert 0 < sum(rewards) < len(rewards), "rewards all equal: the figures would not show much"
    figures = report["checkpoints"][0]["sets"][0]["figures"]["figures"]
    for k in (1, 2, 4):
        expected = sum(pass_at_k(N, sum(s["correct"] for s in p["samples"]), k) for p in prompts_out) / PROMPTS
        assert figures[f"pass@{k}"]["value"] == pytest.approx(expected, abs=1e-12), k
    assert figures[f"avg@{N}"]["value"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-12)
    assert figures["greedy"]["value"] == pytest.approx(sum(p["greedy"]["correct"] for p in prompts_out) / PROMPTS,
                                                       abs=1e-12)
    lengths = [s["length"] for s in samples]
    assert figures["length_mean"]["value"] == pytest.approx(sum(lengths) / len(lengths), abs=1e-12)

    # What the console shows: the tables and the differences, a finished progress line per checkpoint and set.
    assert "| add | run |" in result.stdout and "run/hf_model - run" in result.stdout and "report:" in result.stdout
    for label in ("run", "step_000001", "converted", "run/hf_model", "lora", "lora/hf_model"):
        assert f"eval {label} / add: [{'#' * 24}] {PROMPTS}/{PROMPTS} prompts" in result.stderr, result.stderr

    # `heldout`: the prompts training's evaluate() saw (the run's recorded data section, its eval_prompts), and
    # greedy on them the run's checkpoint scores what the run logged after its last step.
    from megatron_rl.config.loader import load_config_dict
    from megatron_rl.data import load_datasets, prompt_text

    recorded = load_config_dict(json.loads((run / "run.json").read_text())["config"])
    seen = list(load_datasets(recorded.data)[1])[: recorded.rl.eval_prompts or None]
    held = report["checkpoints"][0]["sets"][1]
    assert held["outcome"]["name"] == "held" and held["outcome"]["path"].startswith("synthetic task 'add' (heldout")
    assert [p["prompt"] for p in held["outcome"]["prompts"]] == [prompt_text(r.prompt) for r in seen]
    logged = next(row for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                  if row.get("step") == 1 and "eval/accuracy" in row)
    greedy = [p["greedy"] for p in held["outcome"]["prompts"]]
    assert held["figures"]["figures"]["greedy"]["value"] == pytest.approx(logged["eval/accuracy"], abs=1e-12)
    assert sum(g["reward"] for g in greedy) / len(greedy) == pytest.approx(logged["eval/reward_mean"], abs=1e-12)
    assert sum(g["length"] for g in greedy) / len(greedy) == pytest.approx(logged["eval/length_mean"], abs=1e-12)
