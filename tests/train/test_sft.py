"""`megatron-rl sft` end to end, run as a user runs it (the CLI in subprocesses):

- the supervised loss goes down and every step is in the checkpoint's metrics.jsonl;
- the checkpoint converts to a Hugging Face model with the real conversion tool; `transformers`
  loads it with its tokenizer, and its logits equal the Megatron policy's (loaded from the sft
  checkpoint) within 1e-4;
- `train checkpoint.init_from=<sft dir> warm_start.steps=0` starts RL from exactly the sft weights:
  its step-0 held-out evaluation and its first rollout equal those of a run whose warm start of the
  same settings ran inside `train`;
- with two ranks (expert parallel) it writes a checkpoint that loads at one;
- bad settings are refused in about a second, before any model is built, naming the key.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from _support.processes import REPO, child_env, children_cpu_seconds, cli_command, python_command, torchrun_command

pytestmark = [pytest.mark.engine, pytest.mark.multiprocess]

# The data and warm-start settings both the sft command and the in-train warm start use.
WARM = ["warm_start.steps=25", "warm_start.batch_size=32"]
DATA = ["data.num_heldout=16"]
RL = ["rl.steps=1", "rl.prompts_per_step=8", "rl.group_size=4", "rl.eval_every=0", "checkpoint.every_steps=0",
      "logging.wandb_mode=disabled"]
TEXT = "12+7=19"  # a prompt of the synthetic add task and its answer, in the character tokenizer


def cli(*args: str, torchrun: int = 0, check: bool = True, timeout: int = 900) -> subprocess.CompletedProcess:
    command = torchrun_command("megatron_rl.cli", torchrun, *args, module=True, preloaded=True) if torchrun else \
        cli_command(*args, preloaded=True)
    result = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sft") / "checkpoint"
    result = cli("sft", "--output-dir", str(out), *WARM, *DATA)
    assert f"next: megatron-rl train checkpoint.init_from={out} warm_start.steps=0 {' '.join(DATA)}" in result.stdout
    assert "sft 25/25  loss" in result.stdout
    return out


def test_loss_decreases_and_is_logged(sft_dir):
    log = rows(sft_dir / "metrics.jsonl")
    assert [r["step"] for r in log] == list(range(1, 26))
    losses = [r["sft/loss"] for r in log]
    assert sum(losses[-5:]) / 5 < 0.6 * losses[0], losses
    assert all({"time", "elapsed_s"} <= set(r) for r in log)
    metadata = json.loads((sft_dir / "megatron_rl.json").read_text())
    assert metadata["format"] == "megatron_rl.torch_dist.v1"
    assert metadata["sft"]["steps"] == 25 and metadata["sft"]["final_loss"] == losses[-1]


# The Megatron side: the policy `train` would build, loaded from the sft checkpoint the way
# checkpoint.init_from loads it, then a plain forward of the tokens (full vocabulary, unpadded).
MEGATRON_LOGITS = r"""
import json, sys, torch
from megatron_rl.config import load_config
from megatron_rl.checkpoint.format import load_initial_weights, pin_checkpoint_vocab
from megatron_rl.model.packing import pack
from megatron_rl.model.policy import Policy
from megatron_rl.runtime import start_runtime

checkpoint, tokens, out, overrides, zero_b = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]), sys.argv[5] == "1"
config = pin_checkpoint_vocab(load_config(None, ["device=cpu", f"checkpoint.init_from={checkpoint}", *overrides]))
runtime = start_runtime(config)
policy = Policy(config, runtime)
load_initial_weights(policy, checkpoint)
if zero_b:  # the adapters' contribution taken out: the base model's logits
    for name, param in policy.module.named_parameters():
        if name.endswith(".lora_B"):
            param.data.zero_()
batch = pack([tokens], [1], pad_to_multiple=policy.pad_to_multiple)
policy.module.eval()
with torch.no_grad():
    logits = policy.module(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=None,
                           packed_seq_params=batch.packed_seq_params())[0]
torch.save(logits[: len(tokens), : policy.arch.vocab_size].clone(), out)
runtime.shutdown()
"""


def megatron_logits(checkpoint: Path, tokens: list[int], out: Path, overrides: tuple[str, ...] = (),
                    zero_b: bool = False) -> torch.Tensor:
    """The logits of the policy loaded from `checkpoint` (with `overrides`, e.g. its model.lora;
    `zero_b`: every adapter's B zeroed after the load)."""
    result = subprocess.run(python_command("-c", MEGATRON_LOGITS, checkpoint, json.dumps(tokens), out,
                                           json.dumps(list(overrides)), "1" if zero_b else "0", preloaded=True),
                            env=child_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    return torch.load(out)


def convert_to_hf(checkpoint: Path, out: Path, *flags: str) -> None:
    result = subprocess.run(python_command(REPO / "tools" / "convert_megatron_to_hf.py", "--ckpt", checkpoint,
                                           "--out", out, *flags, preloaded=True),
                            env=child_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]


def test_converts_to_hf_with_its_tokenizer_and_same_logits(sft_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rl.data import build_char_tokenizer

    hf_dir = tmp_path / "hf"
    convert_to_hf(sft_dir, hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)  # the checkpoint carried it
    tokens = tokenizer(TEXT)["input_ids"]
    assert tokens == build_char_tokenizer()(TEXT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model(torch.tensor([tokens])).logits[0]
    mcore = megatron_logits(sft_dir, tokens, tmp_path / "logits.pt")
    assert hf.shape == mcore.shape == (len(tokens), model.config.vocab_size)
    difference = (hf - mcore).abs().max().item()
    assert difference <= 1e-4, difference


def test_train_starts_from_the_sft_weights(sft_dir, tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[rollout-cpu])")
    inside = tmp_path / "inside"  # the warm start inside `train`
    cli("train", "--output-dir", str(inside), *WARM, *DATA, *RL)
    after_sft = tmp_path / "after_sft"
    cli("train", "--output-dir", str(after_sft), f"checkpoint.init_from={sft_dir}", "warm_start.steps=0", *DATA, *RL)
    expected, got = {r["step"]: r for r in rows(inside / "metrics.jsonl")}, {r["step"]: r for r in rows(after_sft / "metrics.jsonl")}

    evaluation = {k: v for k, v in expected[0].items() if k.startswith("eval/")}
    assert evaluation["eval/length_mean"] < 5.0, "the warm start did not teach short answers; the test shows nothing"
    assert {k: v for k, v in got[0].items() if k.startswith("eval/")} == evaluation
    # The first rollout is generated by the start weights too (what follows its first update
    # may differ: a fresh optimizer after sft, the warm start's own Adam moments inside train).
    rollout = {k: v for k, v in expected[1].items() if k.startswith(("reward/", "response/", "rollout/"))}
    assert len(rollout) >= 5, sorted(expected[1])
    assert {k: v for k, v in got[1].items() if k in rollout} == rollout


LORA = ["model.lora.rank=4", "model.lora.alpha=8"]


def test_two_ranks_expert_parallel_lora_checkpoint_loads_at_one(tmp_path):
    """sft with LoRA adapters (every default target: attention and every expert, split over EP2):
    the checkpoint records its model.lora, so the conversion merges the adapters (it used to
    refuse both ways: "pass --merge-lora", then "not a checkpoint of a LoRA run") and
    checkpoint.init_from loads them into a run with the same adapters."""
    out = tmp_path / "ep2"
    cli("sft", "--output-dir", str(out), "warm_start.steps=3", "warm_start.batch_size=8", "parallel.ep=2",
        "parallel.etp=1", *LORA, torchrun=2)
    metadata = json.loads((out / "megatron_rl.json").read_text())
    assert metadata["saved_layout"]["ep"] == 2
    assert (metadata["lora"]["rank"], metadata["lora"]["alpha"]) == (4, 8.0)
    hf_dir = tmp_path / "hf"
    convert_to_hf(out, hf_dir, "--merge-lora")  # read back at one rank, W + (alpha / rank) B A
    from transformers import AutoModelForCausalLM

    tokens = [1, 6, 7, 20, 8, 22]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model(torch.tensor([tokens])).logits[0]
    with_adapters = megatron_logits(out, tokens, tmp_path / "logits.pt", LORA)
    assert (hf - with_adapters).abs().max().item() <= 1e-4
    # Not vacuous: the 3 steps moved B, so the adapters change the logits (B = 0: the base's).
    base = megatron_logits(out, tokens, tmp_path / "base.pt", LORA, zero_b=True)
    assert (hf - base).abs().max().item() > 1e-3, (hf - base).abs().max().item()


@pytest.mark.parametrize("override,expected", [
    ("warm_start.steps=0", "warm_start.steps must be >= 1 for megatron-rl sft, got 0"),
    ("data.train=/no/such/prompts.jsonl", "data.train: /no/such/prompts.jsonl does not exist"),
    ("warm_start.stepz=3", "unknown key 'warm_start.stepz'; did you mean 'steps'?"),
    ("parallel.ep=3", "parallel.ep=3 must divide the number of experts (4)"),
])
def test_bad_input_refused_before_the_model_is_built(tmp_path, override, expected):
    started = children_cpu_seconds()
    result = cli("sft", "--output-dir", str(tmp_path / "out"), override, check=False, timeout=60)
    cpu = children_cpu_seconds() - started
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stderr, result.stderr
    assert cpu < 2.0, f"took {cpu:.2f} s of CPU"
    assert not any(tmp_path.iterdir()), "a refused sft must not write anything"


def test_missing_reference_responses_and_existing_output_refused(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1="}\n')
    result = cli("sft", "--output-dir", str(tmp_path / "out"), f"data.train={prompts}", "data.answer_key=null",
                 check=False, timeout=60)
    assert result.returncode == 2 and "data.answer_key: training record 0" in result.stderr, result.stderr
    (tmp_path / "out").mkdir()
    result = cli("sft", "--output-dir", str(tmp_path / "out"), check=False, timeout=60)
    assert result.returncode == 2 and "already exists and it holds no" in result.stderr, result.stderr
