"""On-policy distillation's advantage (algorithms/distill.py) against hand computation, and the
trainer's loss closure (train/experience.py make_loss_fn) using it: the advantage each token gets
is log pi_teacher - log pi_student (mixed with the reward's by rl.distill_coef), only on the
model's tokens, and the step's gradient does not depend on how the samples are packed into
micro-batches.

The hand-made pair: student p = (1/2, 1/4, 1/4), teacher q = (1/4, 1/2, 1/4) over three tokens.
  d(y) = log q_y - log p_y = (-log 2, +log 2, 0)
  KL(p || q) = 1/2 log 2 - 1/4 log 2 + 0 = 1/4 log 2
  d KL / d z_k = p_k (log(p_k / q_k) - KL)  (z: the student's logits, p = softmax(z))
             = (3/8, -5/16, -1/16) log 2
Four sampled tokens y = 0, 0, 1, 2 (each token as often as p says) make the token-mean
policy-gradient loss's gradient at ratio 1 equal E_{y~p}[-d(y) (e_y - p)] = grad KL(p || q).
"""

from __future__ import annotations

import math

import torch

from megatron_rl.algorithms import (compute_step_normalizer, distillation_advantages, distillation_metrics,
                                    reduce_metrics)
from megatron_rl.algorithms.loss import policy_loss
from megatron_rl.algorithms.recipes import recipe
from megatron_rl.train.experience import Trajectory, make_loss_fn, pack_minibatch, response_masks

LOG2 = math.log(2.0)
P = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
Q = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64)
TOKENS = [0, 0, 1, 2]
D = {0: -LOG2, 1: LOG2, 2: 0.0}  # by hand, above
GRAD_KL = torch.tensor([3 / 8, -5 / 16, -1 / 16], dtype=torch.float64) * LOG2  # by hand, above


def test_the_advantage_is_teacher_minus_student_on_the_mask():
    student = torch.log(P)[TOKENS].reshape(1, 4)
    teacher = torch.log(Q)[TOKENS].reshape(1, 4)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    alone = distillation_advantages(torch.tensor([7.0], dtype=torch.float64), teacher, student, mask, 1.0)
    assert torch.allclose(alone, torch.tensor([[D[0], D[0], D[1], 0.0]], dtype=torch.float64), atol=1e-15, rtol=0)
    mixed = distillation_advantages(torch.tensor([2.0], dtype=torch.float64), teacher, student, mask, 0.25)
    want = [0.75 * 2.0 + 0.25 * D[0]] * 2 + [0.75 * 2.0 + 0.25 * D[1], 0.0]
    assert torch.allclose(mixed, torch.tensor([want], dtype=torch.float64), atol=1e-15, rtol=0)
    # A NaN where the mask is off (padding) never reaches the advantage.
    teacher[0, 3] = float("nan")
    zero = torch.zeros(1, dtype=torch.float64)
    assert torch.isfinite(distillation_advantages(zero, teacher, student, mask, 1.0)).all()
    metrics = reduce_metrics([{**distillation_metrics(teacher, student, mask),
                               "count/tokens/sum": mask.sum().double()}])
    assert abs(metrics["distill/reverse_kl"] - (-(2 * D[0] + D[1]) / 3)) < 1e-15


def test_the_gradient_is_that_of_the_reverse_kl():
    logits = torch.log(P).clone().requires_grad_(True)
    logprobs = torch.log_softmax(logits, -1)[TOKENS].reshape(1, 4)
    student, teacher = logprobs.detach(), torch.log(Q)[TOKENS].reshape(1, 4)
    mask = torch.ones(1, 4, dtype=torch.bool)
    advantages = distillation_advantages(torch.zeros(1, dtype=torch.float64), teacher, student, mask, 1.0)
    loss, _ = policy_loss(logprobs, student, advantages, mask, recipe("dapo").loss)  # token-mean, ratio 1
    loss.backward()
    assert torch.allclose(logits.grad, GRAD_KL, atol=1e-15, rtol=0), (logits.grad, GRAD_KL)


# ---- the trainer's loss closure ------------------------------------------------------------------

def _trajectories(seed: int = 0) -> list[Trajectory]:
    """Five samples of different lengths; the third a multi-turn trajectory whose positions 2-3 are
    an observation (loss mask 0)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for index, length in enumerate([3, 5, 6, 2, 4]):
        prompt = [1 + index, 2, 3][: 1 + index % 3]
        response = torch.randint(4, 20, (length,), generator=generator).tolist()
        trajectory = Trajectory(index // 2, prompt, response, [-1.0] * length, False, reward=float(index % 2),
                                advantage=[0.5, -1.0, 2.0, 0.0, -0.25][index])
        trajectory.old_logprobs = -torch.rand(length, generator=generator) * 3
        trajectory.teacher_logprobs = -torch.rand(length, generator=generator) * 3
        if index == 2:
            trajectory.loss_mask = [1, 1, 0, 0, 1, 1]
        out.append(trajectory)
    return out


def _advantage_by_gradient(trajectories, token_budget: int, distill_coef: float) -> list[torch.Tensor]:
    """The per-token advantage the loss closure used, read from its gradient: at ratio 1 the
    token-mean loss is -sum_t A_t r_t / N, so d loss / d logp_t = -A_t / N."""
    rcp = recipe("dapo")
    batches = pack_minibatch(trajectories, token_budget, 1)
    normalizer = compute_step_normalizer(response_masks(batches, trajectories, rcp), rcp.loss.loss_agg_mode,
                                         rcp.loss.l_norm)
    loss_fn = make_loss_fn(trajectories, rcp, normalizer, old_from_forward=False, use_ref=False,
                           distill_coef=distill_coef)
    grads: dict[int, torch.Tensor] = {}
    for batch in batches:
        current = torch.zeros(batch.num_tokens)
        for sample_id, (start, end) in zip(batch.sample_ids, batch.response_segments()):
            current[start:end] = trajectories[sample_id].old_logprobs
        current.requires_grad_(True)
        loss, metrics = loss_fn(current, None, batch)
        loss.backward()
        for sample_id, (start, end) in zip(batch.sample_ids, batch.response_segments()):
            grads[sample_id] = current.grad[start:end].clone()
    return [-grads[i] * normalizer.num_tokens for i in range(len(trajectories))]


def test_the_loss_closure_trains_on_teacher_minus_student_and_no_split_changes_it():
    trajectories = _trajectories()
    for distill_coef in (1.0, 0.3):
        whole = _advantage_by_gradient(trajectories, token_budget=4096, distill_coef=distill_coef)
        split = _advantage_by_gradient(trajectories, token_budget=9, distill_coef=distill_coef)  # several micro-batches
        for trajectory, got, again in zip(trajectories, whole, split):
            mask = trajectory.token_mask(False).double()
            signal = trajectory.teacher_logprobs.double() - trajectory.old_logprobs.double()
            want = ((1 - distill_coef) * trajectory.advantage + distill_coef * signal) * mask
            assert torch.allclose(got.double(), want, atol=1e-5, rtol=0), (distill_coef, got, want)
            assert torch.allclose(again, got, atol=1e-6, rtol=0)
