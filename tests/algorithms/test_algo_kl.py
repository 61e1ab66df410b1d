"""KL estimators: values and autograd gradients against closed forms, clamps, aliases."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms import kl_penalty
from megatron_rl.algorithms.kl import canonical_kl_type

X = torch.tensor([-2.0, -0.3, 0.0, 0.1, 1.5], dtype=torch.float64)  # logp - ref_logp

CLOSED = {  # (value, d value / d logp)
    "k1": (lambda x: x, lambda x: torch.ones_like(x)),
    "k2": (lambda x: x * x / 2, lambda x: x),
    "k3": (lambda x: torch.exp(-x) - 1 + x, lambda x: 1 - torch.exp(-x)),
    "k3+": (lambda x: torch.exp(-x) - 1 + x, lambda x: x),
}


@pytest.mark.parametrize("kind", list(CLOSED))
def test_value_and_gradient(kind):
    ref = torch.full_like(X, -1.0)
    lp = (ref + X).requires_grad_(True)
    out = kl_penalty(lp, ref, kind, input_clamp=None, output_clamp=None)
    out.sum().backward()
    value, grad = CLOSED[kind]
    torch.testing.assert_close(out.detach(), value(X), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lp.grad, grad(X), rtol=1e-12, atol=1e-12)
    if kind in ("k2", "k3", "k3+"):
        assert (out >= 0).all()


def test_clamps():
    ref = torch.zeros(3, dtype=torch.float64)
    lp = torch.tensor([-50.0, 0.5, 50.0], dtype=torch.float64, requires_grad=True)
    out = kl_penalty(lp, ref, "k3", input_clamp=20.0, output_clamp=10.0)
    assert torch.isfinite(out).all() and out.max() <= 10.0
    out.sum().backward()
    assert lp.grad[0] == 0 and lp.grad[2] == 0 and lp.grad[1] != 0  # clamped entries: no gradient
    lp2 = lp.detach().clone().requires_grad_(True)
    out2 = kl_penalty(lp2, ref, "k3+", input_clamp=20.0, output_clamp=10.0)
    out2.sum().backward()
    torch.testing.assert_close(out2.detach(), out.detach())  # k3 value (output-clamped)
    torch.testing.assert_close(lp2.grad, torch.tensor([0.0, 0.5, 0.0], dtype=torch.float64))  # k2 gradient


def test_aliases_and_errors():
    assert canonical_kl_type("low_var_kl") == "k3"
    assert canonical_kl_type("mse") == "k2"
    assert canonical_kl_type("kl") == "k1"
    assert canonical_kl_type("low_var_kl+") == "k3+"
    with pytest.raises(ValueError, match="kl_loss_type"):
        canonical_kl_type("abs")
    with pytest.raises(ValueError, match="shape"):
        kl_penalty(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="input_clamp"):
        kl_penalty(torch.zeros(3), torch.zeros(3), input_clamp=0.0)
    assert kl_penalty(torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2)).dtype == torch.float32
