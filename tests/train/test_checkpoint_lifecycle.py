"""A trained policy's way out, and checkpoints a cluster user relies on (real runs, real files).

One short training run (module fixture) is the subject:
- its checkpoint converts to a Hugging Face model with the tools script, bit-exact to the live
  weights the run exported at its end, from the run directory or a step directory, read at
  another layout; transformers loads it and vLLM serves it;
- started from that model (or the step directory) with no warm start, a new run measures exactly
  the held-out accuracy the trained run reported at that step;
- bytes flipped in place in the newest checkpoint are named on resume, the previous checkpoint
  is used, and the re-run step equals the original bit for bit;
- a checkpoint written by 2 processes at EP2 resumes on 1 process.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from _support.processes import REPO, child_env, python_command, torchrun_command

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[rollout-cpu])")

from run_records import comparable, metrics  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.multiprocess]

# An easy task (sums of numbers up to 12) and a longer warm start so that the trained policy's accuracy is far from a
# fresh one's and "the same accuracy" means something.
SHORT = ["rl.steps=5", "rl.prompts_per_step=8", "rl.group_size=4", "rl.max_response_tokens=6",
         "warm_start.steps=150", "data.synthetic.max_operand=12", "data.num_heldout=12", "rl.eval_every=2",
         "checkpoint.every_steps=2", "logging.wandb_mode=disabled"]


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(python_command(*args, preloaded=True, children=True), env=child_env(), capture_output=True,
                            text=True, timeout=900)
    if check:
        assert result.returncode == 0, f"{' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def train(out: Path, *overrides: str, check: bool = True) -> subprocess.CompletedProcess:
    return run("-m", "megatron_rl.cli", "train", "--output-dir", str(out), *SHORT, *overrides, check=check)


def safetensors_of(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


# The trained run's warm start: long enough that the policy it ends with is far from a fresh one
# whatever the CPU's kernels. With SHORT's 150 steps, on an AMD EPYC without AVX-512 (Zen 3) the
# held-out accuracy after RL was 2/12, too close to a fresh policy's 0 (its evaluations read
# 3/12, 4/12, 3/12, 2/12: RL's steps on 12 prompts move it by a prompt or two); with 250, 5/12.
TRAINED = ["warm_start.steps=250"]


# "Learned" is measured against a paired control, never an absolute figure that depends on the
# CPU's kernels: the trained policy answers at least two more of the 12 held-out prompts than the
# untrained one does on the same prompts.
LEARNED_MARGIN = 2 / 12


@pytest.fixture(scope="module")
def untrained_accuracy(tmp_path_factory) -> float:
    """The control: the same held-out prompts, evaluated by a fresh policy (no warm start, no
    RL step before the evaluation at step 0)."""
    out = tmp_path_factory.mktemp("lifecycle") / "fresh"
    train(out, "warm_start.steps=0", "rl.steps=1")
    return metrics(out)[0]["eval/accuracy"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lifecycle") / "run"
    train(out, *TRAINED)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000004", "step_000005"]
    return out


def test_trained_checkpoint_converts_bit_exact_and_loads_in_transformers(trained, tmp_path):
    exported = safetensors_of(trained / "hf_model")  # written from the live weights at the end
    # From the run directory (its latest checkpoint), with the tools script, read by one process.
    run(str(REPO / "tools" / "convert_megatron_to_hf.py"), "--ckpt", str(trained), "--out", str(tmp_path / "hf"))
    converted = safetensors_of(tmp_path / "hf")
    assert sorted(converted) == sorted(exported) and converted
    for name in exported:
        assert torch.equal(converted[name], exported[name]), name
    # From the step directory, with the CLI.
    run("-m", "megatron_rl.cli", "convert", "megatron-to-hf", "--ckpt", str(trained / "checkpoints" / "step_000005"),
        "--out", str(tmp_path / "hf_step"))
    for name, tensor in safetensors_of(tmp_path / "hf_step").items():
        assert torch.equal(tensor, exported[name]), name

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = torch.tensor([tokenizer("1+2=")["input_ids"]])
    assert torch.isfinite(model(ids).logits).all()
    export = json.loads((trained / "hf_model" / "megatron_rl_export.json").read_text())
    assert export["step"] == 5 and export["run"] == str(trained.resolve()) and export["prompt_format"] == "raw"
    generation = json.loads((trained / "hf_model" / "generation_config.json").read_text())
    assert generation["max_new_tokens"] == 6 and generation["eos_token_id"] == tokenizer.eos_token_id


@pytest.mark.parametrize("source", ["hf_model", "checkpoints/step_000005"])
def test_new_run_from_the_trained_policy_measures_its_accuracy(trained, untrained_accuracy, tmp_path, source):
    reported = metrics(trained)[5]
    # Far from the untrained policy's accuracy, so that measuring the same value means something.
    assert reported["eval/accuracy"] >= untrained_accuracy + LEARNED_MARGIN, (reported, untrained_accuracy)
    train(tmp_path / "again", "warm_start.steps=0", "rl.steps=1", f"checkpoint.init_from={trained / source}")
    measured = metrics(tmp_path / "again")[0]
    for key in ("eval/accuracy", "eval/reward_mean", "eval/length_mean"):
        assert measured[key] == reported[key], (key, measured, reported)


def test_untrained_policy_has_another_accuracy(trained, untrained_accuracy):
    """The control for the test above: without the trained weights the accuracy differs."""
    assert untrained_accuracy != metrics(trained)[5]["eval/accuracy"]


def test_vllm_serves_the_exported_model_as_transformers_does(trained, tmp_path):
    script = tmp_path / "serve.py"
    script.write_text(f"""
import json, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from megatron_rl.rollout import SamplingParams
from megatron_rl.rollout.engines.vllm_colocated import VllmColocatedEngine
path = {str(trained / "hf_model")!r}
tokenizer = AutoTokenizer.from_pretrained(path)
prompts = [tokenizer(text)["input_ids"] for text in ("1+2=", "3+0=", "2+2=")]
engine = VllmColocatedEngine(path, dtype="float32", max_model_len=64)
served = [group[0].response_token_ids for group in engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_tokens=4))]
engine.shutdown()
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
reference = []
for prompt in prompts:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, eos_token_id=tokenizer.eos_token_id)
    reference.append(out[0, len(prompt):].tolist())
print(json.dumps({{"served": served, "reference": reference}}))
""")
    result = json.loads(run(str(script)).stdout.strip().splitlines()[-1])
    assert result["served"] == result["reference"] and all(result["served"]), result


def test_corrupt_newest_checkpoint_is_named_and_the_rerun_step_is_bit_exact(trained, tmp_path, flip_bytes_in_place):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    original = metrics(trained)
    (shard, *_) = sorted((copy / "checkpoints" / "step_000005" / "weights").glob("*.distcp"))
    size = shard.stat().st_size
    inspect = str(REPO / "tools" / "inspect_checkpoint.py")
    assert "verify (sizes and CRC-32 checksums): ok" in run(inspect, str(copy)).stdout  # the latest: step 5
    flip_bytes_in_place(shard)
    assert shard.stat().st_size == size
    damaged = run(inspect, str(copy), check=False)
    assert damaged.returncode == 1 and f"FAILED: file weights/{shard.name} is corrupt" in damaged.stdout, damaged.stdout
    result = train(copy, *TRAINED)
    assert f"skipping unusable checkpoint {copy / 'checkpoints' / 'step_000005'}: file weights/{shard.name} is corrupt" \
        in result.stdout, result.stdout[-3000:]
    assert f"resumed from {copy / 'checkpoints' / 'step_000004'} at step 4" in result.stdout
    after = metrics(copy)
    assert sorted(after) == sorted(original)
    assert comparable(after[5]) == comparable(original[5])


def test_every_checkpoint_corrupt_refuses_then_resume_none_moves_the_run_aside(trained, tmp_path, flip_bytes_in_place):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    for step in ("step_000004", "step_000005"):
        flip_bytes_in_place(sorted((copy / "checkpoints" / step / "weights").glob("*.distcp"))[0])
    before = (copy / "metrics.jsonl").read_text()
    refused = train(copy, *TRAINED, check=False)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "no checkpoint in" in refused.stderr and "checkpoint.resume=none" in refused.stderr
    assert (copy / "metrics.jsonl").read_text() == before  # nothing written or lost

    started_over = train(copy, "checkpoint.resume=none", "rl.steps=1", "warm_start.steps=2")
    (previous,) = copy.glob("previous-*")
    assert f"moved into {previous}" in started_over.stdout
    assert (previous / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in (previous / "checkpoints").iterdir()) == ["latest", "step_000004", "step_000005"]
    assert sorted(metrics(copy)) == [0, 1]


# LoRA (model.lora): the checkpoint holds the adapters (B split over TP, the experts' over EP)
# and refers to the base the run wrote at its start; the resume loads the base, then the adapters
# at the new layout; the conversion merges them (--merge-lora).
RESUMED_LORA = ["model.lora.rank=4", "model.lora.alpha=8", "optimizer.lr=2e-3"]
# Step 3 resumed on 1 process against the same step of the 2-process run: other reduction orders
# in fp32 (measured 5e-7 relative on loss, grad norm and KL).
RESUME_REL_TOL = 1e-5


@pytest.mark.parametrize("variant", ["full", "lora"])
def test_tp2_ep2_checkpoint_resumes_on_one_process_and_converts(tmp_path, variant):
    """Written by 2 processes at TP2 x EP2 with a 300-token vocabulary (Megatron pads it to 512
    rows at TP2, to 384 at TP1): resumed on 1 process, KL reference included, its next step the
    2-process run's; then converted. The whole model, or LoRA adapters over a referenced base."""
    from megatron_rl.model.hf_config import load_hf_config

    raw, _ = load_hf_config("tiny-qwen3-moe")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(dict(raw, vocab_size=300)))
    out = tmp_path / "run"
    common = ["rl.steps=3", "warm_start.steps=4", "rl.recipe=grpo", f"model.hf_config={tmp_path / 'model'}",
              *(RESUMED_LORA if variant == "lora" else [])]
    command = torchrun_command("megatron_rl.cli", 2, "train", "--output-dir", str(out), *SHORT, *common,
                               "parallel.tp=2", "parallel.ep=2", "parallel.etp=1", module=True, preloaded=True)
    result = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    step2 = out / "checkpoints" / "step_000002"
    state = json.loads((step2 / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and "reference" in state["keyed_like_weights"]
    recorded = json.loads((step2 / "megatron_rl.json").read_text())
    assert recorded["padded_vocab_size"] == 512
    assert ("base" in recorded) == (variant == "lora")
    uninterrupted = metrics(out)[3]
    shutil.rmtree(out / "checkpoints" / "step_000003")  # resume from step 2

    one = train(out, *common)
    assert "checkpoint was written by 2 ranks, now 1" in one.stdout
    assert f"resumed from {step2} at step 2" in one.stdout
    after = metrics(out)
    assert sorted(after) == [0, 1, 2, 3] and after[3]["train/grad_norm"] > 0
    assert any(key.startswith("actor/kl") for key in after[3]), after[3]
    for key in ("train/loss", "train/grad_norm", "actor/kl"):
        assert abs(after[3][key] - uninterrupted[key]) <= RESUME_REL_TOL * abs(uninterrupted[key]), \
            (key, after[3][key], uninterrupted[key])

    # The 1-process checkpoint keeps the 512 rows; conversion reuses them and drops the padding.
    assert json.loads((out / "checkpoints" / "step_000003" / "megatron_rl.json").read_text())["padded_vocab_size"] == 512
    run(str(REPO / "tools" / "convert_megatron_to_hf.py"), "--ckpt", str(out), "--out", str(tmp_path / "hf"),
        *(["--merge-lora"] if variant == "lora" else []))
    converted, exported = safetensors_of(tmp_path / "hf"), safetensors_of(out / "hf_model")
    assert converted["model.embed_tokens.weight"].shape[0] == 300
    assert sorted(converted) == sorted(exported)
    for name in exported:
        assert torch.equal(converted[name], exported[name]), name
