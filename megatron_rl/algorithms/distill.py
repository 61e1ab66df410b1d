"""On-policy distillation's advantage: the teacher's per-token reverse-KL signal.

The student samples y ~ pi_S, the teacher scores every sampled token, and each token's
advantage is the one-sample estimate of the negative reverse KL at that position::

    d_t = log pi_T(y_t | y_<t) - log pi_S(y_t | y_<t)

(Agarwal et al. 2024, "On-Policy Distillation of Language Models", arXiv:2306.13649; Qwen3
technical report, arXiv:2505.09388 §4.5; Thinking Machines, "On-Policy Distillation", 2025). Used
as the advantage of the policy-gradient loss, its expected gradient is that of KL(pi_S || pi_T)
with the sign of a loss: at ratio 1, E_y[-d(y) grad log pi_S(y)] = grad KL(pi_S || pi_T).
The student's logprobs are a constant here (the old policy's: the one that sampled, as the
trainer computed it), so d_t is a constant advantage like the reward's.

``distill_coef`` = lambda mixes it with the reward's per-sample advantage A_i::

    A_t = (1 - lambda) A_i + lambda d_t          (lambda = 1: distillation alone)

Tokens outside the mask (observations of a multi-turn trajectory, padding, truncated samples
the recipe masks) get 0 and leave the loss by its mask anyway.
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms._checks import check_float, check_mask, check_same_shape

__all__ = ["distillation_signal", "distillation_advantages", "distillation_metrics"]


def distillation_signal(teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` d_t = log pi_T(y_t) - log pi_S(y_t) on the mask, 0 elsewhere (a NaN or
    inf outside the mask never reaches the result). Detached."""
    check_float(teacher_logprobs, "teacher_logprobs", dim=2)
    check_float(student_logprobs, "student_logprobs", dim=2)
    check_same_shape(teacher_logprobs, student_logprobs, "teacher_logprobs", "student_logprobs")
    m = check_mask(mask)
    check_same_shape(m, teacher_logprobs, "mask", "teacher_logprobs")
    zero = torch.zeros((), dtype=teacher_logprobs.dtype, device=teacher_logprobs.device)
    teacher = torch.where(m, teacher_logprobs.detach(), zero)
    student = torch.where(m, student_logprobs.detach().to(teacher.dtype), zero)
    return teacher - student


def distillation_advantages(reward_advantages: torch.Tensor, teacher_logprobs: torch.Tensor,
                            student_logprobs: torch.Tensor, mask: torch.Tensor, distill_coef: float) -> torch.Tensor:
    """``[batch, seq]`` per-token advantages ``(1 - distill_coef) A + distill_coef d_t`` on the
    mask, 0 elsewhere. ``reward_advantages``: ``[batch]`` per sample or ``[batch, seq]`` per token;
    ``distill_coef`` in (0, 1]."""
    if not 0 < distill_coef <= 1:
        raise ValueError(f"distill_coef must be in (0, 1], got {distill_coef}")
    signal = distillation_signal(teacher_logprobs, student_logprobs, mask)
    check_float(reward_advantages, "reward_advantages", dim=(1, 2))
    reward = reward_advantages.detach().to(signal.dtype)
    reward = reward.unsqueeze(-1).expand_as(signal) if reward.dim() == 1 else reward
    check_same_shape(reward, signal, "reward_advantages", "teacher_logprobs")
    mixed = signal * distill_coef
    if distill_coef < 1:  # at 1 the reward's advantage is not read at all (it may be anything)
        mixed = mixed + (1.0 - distill_coef) * reward
    return torch.where(check_mask(mask), mixed, torch.zeros((), dtype=mixed.dtype, device=mixed.device))


def distillation_metrics(teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor,
                         mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Combinable sums (``metrics.reduce_metrics``) over the mask's tokens:
    ``distill/reverse_kl`` (token mean of log pi_S - log pi_T: the one-sample estimate of the
    per-token KL(pi_S || pi_T) that distillation drives down), ``distill/teacher_logprob`` and
    ``distill/student_logprob`` (token means), ``distill/reverse_kl_max``."""
    m = check_mask(mask)
    signal = distillation_signal(teacher_logprobs, student_logprobs, m).double()
    zero = torch.zeros((), dtype=torch.float64, device=signal.device)
    teacher = torch.where(m, teacher_logprobs.detach().double(), zero)
    student = torch.where(m, student_logprobs.detach().double(), zero)
    kl = -signal
    peak = kl.masked_fill(~m, float("-inf")).max() if kl.numel() else torch.tensor(float("-inf"), dtype=torch.float64)
    return {"distill/reverse_kl/tok_sum": kl.sum(), "distill/reverse_kl_max/max": peak,
            "distill/teacher_logprob/tok_sum": teacher.sum(), "distill/student_logprob/tok_sum": student.sum()}
