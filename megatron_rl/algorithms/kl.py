"""Per-token KL estimators between the policy and a frozen reference (Schulman's k1/k2/k3).

Only the sampled token's log-probability is available, so KL(pi || pi_ref) is estimated from
``log_ratio = logp - ref_logp`` of tokens sampled from (approximately) pi
(J. Schulman, "Approximating KL Divergence", 2020, http://joschu.net/blog/kl-approx.html):

====== ================================= ============================ =========================
type   value                             d value / d logp             verl name
====== ================================= ============================ =========================
k1     log_ratio                         1                            ``kl``
k2     log_ratio^2 / 2                   log_ratio                    ``mse``
k3     exp(-log_ratio) - 1 + log_ratio   1 - exp(-log_ratio)          ``low_var_kl``
k3+    k3 (straight-through)             log_ratio (k2's gradient)    ``low_var_kl+`` / ``k3+``
====== ================================= ============================ =========================

k3 is unbiased and always >= 0 (GRPO puts it in the loss: DeepSeekMath arXiv:2402.03300 Eq. 4),
but as a loss its expected gradient, -E_pi[(pi_ref/pi) grad logp], is the gradient of the
forward KL(pi_ref || pi), not of KL(pi || pi_ref). The k2 loss's expected gradient,
E_pi[log_ratio grad logp], is exactly grad KL(pi || pi_ref) for on-policy samples (Tang & Munos
2025, "On a Few Pitfalls in KL Divergence Gradient Estimation for RL"). k3+ therefore reports
the k3 value and follows the k2 gradient.

Clamps, as in verl: ``input_clamp`` bounds ``log_ratio`` before the exp (k3 overflows past ~88
in fp32), ``output_clamp`` bounds the estimate. A clamped entry has zero gradient (k3+ keeps
the k2 gradient of the input-clamped log-ratio, since the output clamp applies to its value).
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms._checks import check_float, check_same_shape, finite_number

__all__ = ["KL_TYPES", "KL_ALIASES", "canonical_kl_type", "kl_penalty"]

KL_TYPES = ("k1", "k2", "k3", "k3+")
# Names users know from verl (kl_loss_type) and elsewhere -> our canonical names.
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "low_var_kl+": "k3+", "k3_plus": "k3+"}


def canonical_kl_type(kl_type: str) -> str:
    """Map an alias (``low_var_kl``, ``mse``, ``kl``, ...) to k1/k2/k3/k3+; ValueError otherwise."""
    name = KL_ALIASES.get(kl_type, kl_type) if isinstance(kl_type, str) else kl_type
    if name not in KL_TYPES:
        raise ValueError(f"kl_loss_type must be one of {KL_TYPES} or an alias in {sorted(KL_ALIASES)}, got {kl_type!r}")
    return name


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kl_type: str = "k3",
    *,
    input_clamp: float | None = 20.0,
    output_clamp: float | None = 10.0,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref); differentiable w.r.t. ``logprobs`` only.

    Args:
        logprobs, ref_logprobs: same-shaped per-token log-probabilities of the sampled tokens.
        kl_type: k1, k2, k3, k3+ or an alias (see the module docstring).
        input_clamp: |log_ratio| bound before the estimator (None = no clamp).
        output_clamp: |estimate| bound (None = no clamp).

    Returns a tensor shaped like ``logprobs``, in the wider of the two dtypes (>= float32).
    """
    check_float(logprobs, "logprobs")
    check_float(ref_logprobs, "ref_logprobs")
    check_same_shape(ref_logprobs, logprobs, "ref_logprobs", "logprobs")
    name = canonical_kl_type(kl_type)
    finite_number(input_clamp, "input_clamp", low=0.0, low_open=True, allow_none=True)
    finite_number(output_clamp, "output_clamp", low=0.0, low_open=True, allow_none=True)
    dtype = torch.float64 if torch.float64 in (logprobs.dtype, ref_logprobs.dtype) else torch.float32
    lr = logprobs.to(dtype) - ref_logprobs.detach().to(dtype)
    if input_clamp is not None:
        lr = lr.clamp(-input_clamp, input_clamp)

    def clamp_out(x: torch.Tensor) -> torch.Tensor:
        return x if output_clamp is None else x.clamp(-output_clamp, output_clamp)

    if name == "k1":
        return clamp_out(lr)
    if name == "k2":
        return clamp_out(0.5 * lr * lr)
    k3 = torch.expm1(-lr) + lr  # exp(-x) - 1 + x, accurate near x = 0
    if name == "k3":
        return clamp_out(k3)
    k2 = 0.5 * lr * lr
    return k2 - k2.detach() + clamp_out(k3).detach()  # value k3, gradient k2
