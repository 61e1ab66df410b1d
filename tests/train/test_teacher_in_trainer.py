"""On-policy distillation with the teacher held in the trainer (rl.teacher.mode: trainer), in one
short process: a 4-layer teacher (a Hugging Face directory) beside the tiny default's 2-layer
student, both Megatron models of the same ranks.

- the teacher logprobs the trajectories receive (TrainerTeacher.score over the step's packed
  micro-batches) equal transformers' logprobs of the teacher model on the same tokens (<= 1e-4);
- the advantage the loss closure trains each token on is the teacher's logprob minus the
  student's (read back from the closure's gradient), 0 on a multi-turn observation.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from _support.processes import REPO, child_env, python_command

pytestmark = pytest.mark.subprocess

SCRIPT = r"""
import json, sys, torch
from megatron_rl.algorithms.from_config import recipe_for
from megatron_rl.config import load_config
from megatron_rl.model.policy import Policy
from megatron_rl.runtime import start_runtime
from megatron_rl.train.experience import Trajectory, make_loss_fn, pack_step, response_masks, step_normalizer
from megatron_rl.train.teacher import build_teacher
from megatron_rl.train.update import LossSettings, store_step_logprobs

teacher_dir, sequences, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
config = load_config(None, ["device=cpu", f"rl.teacher.source={teacher_dir}", "rl.teacher.mode=trainer",
                            "rl.updates_per_rollout=1"])
runtime = start_runtime(config)
policy = Policy(config, runtime)   # the student: the tiny default, 2 layers
teacher = build_teacher(config, runtime)
rows = []
for index, (prompt, response, loss_mask) in enumerate(sequences):
    rows.append(Trajectory(0, prompt, response, [0.0] * len(response), False, 0.0, advantage=3.0, loss_mask=loss_mask))
groups = [rows]
experience = pack_step(groups, dp_rank=0, dp_size=1, updates=1, token_budget=24, pad_to_multiple=policy.pad_to_multiple)
teacher.score(groups, experience)
store_step_logprobs(policy, experience, "old_logprobs", None, temperature=1.0)
recipe = recipe_for(config.rl)
settings = LossSettings.for_run(config, recipe)
batches = experience.packed[0]
normalizer = step_normalizer(response_masks(batches, rows, recipe), recipe, None, "cpu")
loss_fn = make_loss_fn(rows, recipe, normalizer, old_from_forward=False, use_ref=False,
                       distill_coef=settings.distill_coef)
advantages = {}
for batch in batches:
    current = torch.zeros(batch.num_tokens)
    for sample_id, (start, end) in zip(batch.sample_ids, batch.response_segments()):
        current[start:end] = rows[sample_id].old_logprobs
    current.requires_grad_(True)
    loss, metrics = loss_fn(current, None, batch)
    loss.backward()
    for sample_id, (start, end) in zip(batch.sample_ids, batch.response_segments()):
        advantages[sample_id] = (-current.grad[start:end] * normalizer.num_tokens).tolist()
json.dump({"distill_coef": settings.distill_coef, "micro_batches": len(batches),
           "teacher": [t.teacher_logprobs.tolist() for t in rows], "student": [t.old_logprobs.tolist() for t in rows],
           "advantages": [advantages[i] for i in range(len(rows))]}, open(out, "w"))
"""


def write_teacher(directory: Path) -> Path:
    """A 4-layer teacher with the tiny default's vocabulary and tokenizer, random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_rl.config import load_config
    from megatron_rl.rollout.engine_model import write_engine_model_dir

    write_engine_model_dir(load_config(), directory)
    config = AutoConfig.from_pretrained(directory)
    config.num_hidden_layers, config.initializer_range = 4, 0.2
    if hasattr(config, "mlp_only_layers"):
        config.mlp_only_layers = []
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).save_pretrained(directory)
    return directory


def test_the_trainer_held_teacher_scores_as_transformers_and_sets_the_advantage(tmp_path):
    from transformers import AutoModelForCausalLM

    teacher_dir = write_teacher(tmp_path / "teacher")
    generator = torch.Generator().manual_seed(0)
    sequences = []
    for index, length in enumerate([5, 7, 4]):
        prompt = torch.randint(3, 20, (3 + index,), generator=generator).tolist()
        response = torch.randint(3, 20, (length,), generator=generator).tolist()
        loss_mask = [1, 1, 0, 0, 1, 1, 1] if index == 1 else None  # a multi-turn observation at 2-3
        sequences.append((prompt, response, loss_mask))
    out = tmp_path / "out.json"
    result = subprocess.run(python_command("-c", SCRIPT, teacher_dir, json.dumps(sequences), out, preloaded=True), cwd=REPO,
                            env=child_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["distill_coef"] == 1.0 and got["micro_batches"] > 1

    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, torch_dtype=torch.float32).eval()
    assert teacher.config.num_hidden_layers == 4
    for (prompt, response, loss_mask), mine, student, advantage in zip(sequences, got["teacher"], got["student"],
                                                                      got["advantages"]):
        with torch.no_grad():
            logits = teacher(torch.tensor([prompt + response])).logits[0, len(prompt) - 1: -1].double()
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        assert float((torch.tensor(mine, dtype=torch.float64) - want).abs().max()) <= 1e-4
        mask = torch.tensor(loss_mask or [1] * len(response), dtype=torch.float64)
        signal = (torch.tensor(mine, dtype=torch.float64) - torch.tensor(student, dtype=torch.float64)) * mask
        assert torch.allclose(torch.tensor(advantage, dtype=torch.float64), signal, atol=1e-5, rtol=0)
        assert float(signal.abs().max()) > 0.05  # teacher and student differ
