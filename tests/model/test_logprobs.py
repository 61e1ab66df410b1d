"""Tests for megatron_rl.model.logprobs (values + gradients vs a float64 oracle, chunking,
vocab padding, temperature, real 2-rank tensor parallelism over gloo, input validation)."""

from __future__ import annotations

import datetime
import subprocess

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _support.processes import REPO, free_port, python_command
from megatron_rl.model.logprobs import naive_logprobs_entropy, vocab_parallel_logprobs_entropy

pytestmark = pytest.mark.multiprocess


# ----------------------------------------------------------------------------- helpers
def oracle(logits, targets, vocab_size=None, temperature=1.0):
    """Independent float64 computation on the full vocabulary."""
    z = logits.double()
    if vocab_size is not None:
        z = z[..., :vocab_size]
    logp_all = torch.log_softmax(z / temperature, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


def make_inputs(lead, vocab, dtype=torch.float32, scale=3.0, seed=0, target_vocab=None):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*lead, vocab, generator=g, dtype=torch.float64) * scale).to(dtype)
    targets = torch.randint(0, target_vocab or vocab, lead, generator=g)
    up_logp = torch.randn(lead, generator=g, dtype=torch.float64)
    up_ent = torch.randn(lead, generator=g, dtype=torch.float64)
    return logits, targets, up_logp, up_ent


def run_ours(logits, targets, up_logp, up_ent, **kw):
    """Values and logits-grad of ours with random upstream grads on both outputs."""
    x = logits.detach().clone().requires_grad_(True)
    logp, ent = vocab_parallel_logprobs_entropy(x, targets, **kw)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    ((logp * up_logp.float()).sum() + (ent * up_ent.float()).sum()).backward()
    assert x.grad.dtype == logits.dtype
    return logp.detach(), ent.detach(), x.grad


def run_oracle(logits, targets, up_logp, up_ent, vocab_size=None, temperature=1.0):
    """float64 oracle values and grad (grad of padding columns is zero by construction)."""
    x = logits.detach().double().requires_grad_(True)
    logp, ent = oracle(x, targets, vocab_size, temperature)
    ((logp * up_logp).sum() + (ent * up_ent).sum()).backward()
    return logp.detach(), ent.detach(), x.grad


def close(a, b, tol):
    torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- oracle
@pytest.mark.parametrize("lead", [(13,), (2, 5), (3, 2, 4)])
def test_fp32_matches_float64_oracle(lead):
    args = make_inputs(lead, vocab=50)
    lp, h, g = run_ours(*args, chunk_tokens=4)
    lp_o, h_o, g_o = run_oracle(*args)
    assert lp.shape == lead and h.shape == lead
    close(lp, lp_o, 1e-5)
    close(h, h_o, 1e-5)
    close(g, g_o, 1e-5)


def test_large_magnitude_logits_are_stable():
    logits, t, ul, ue = make_inputs((9,), vocab=40, scale=30.0)
    logits = logits + 1000.0  # exp would overflow without max-shifting
    args = (logits, t, ul, ue)
    lp, h, g = run_ours(*args, chunk_tokens=4)
    lp_o, h_o, g_o = run_oracle(*args)
    # fp32 resolution near 1000 is ~6e-5, so inputs themselves are only that precise
    close(lp, lp_o, 1e-4)
    close(h, h_o, 1e-4)
    close(g, g_o, 1e-4)


def test_bf16_input_matches_oracle_of_same_values():
    args = make_inputs((17,), vocab=64, dtype=torch.bfloat16)
    lp, h, g = run_ours(*args, chunk_tokens=5)
    lp_o, h_o, g_o = run_oracle(*args)  # oracle on the exact bf16 values, in float64
    close(lp, lp_o, 1e-5)  # computation is fp32: values are fp32-accurate
    close(h, h_o, 1e-5)
    close(g, g_o, 1e-2)  # gradient is stored in bf16 (8 mantissa bits)


def test_fp16_input():
    args = make_inputs((11,), vocab=33, dtype=torch.float16)
    lp, h, g = run_ours(*args, chunk_tokens=4)
    lp_o, h_o, g_o = run_oracle(*args)
    close(lp, lp_o, 1e-5)
    close(h, h_o, 1e-5)
    close(g, g_o, 2e-3)


def test_naive_reference_matches_oracle():
    logits, t, _, _ = make_inputs((6,), vocab=30, target_vocab=25)
    lp, h = naive_logprobs_entropy(logits, t, vocab_size=25, temperature=1.3)
    lp_o, h_o = oracle(logits, t, vocab_size=25, temperature=1.3)
    close(lp, lp_o, 1e-5)
    close(h, h_o, 1e-5)


# ----------------------------------------------------------------------------- gradients of one output
@pytest.mark.parametrize("which", ["logp", "entropy"])
def test_gradient_of_single_output(which):
    logits, t, _, _ = make_inputs((8,), vocab=21)
    x = logits.clone().requires_grad_(True)
    lp, h = vocab_parallel_logprobs_entropy(x, t, chunk_tokens=3, temperature=0.8)
    (lp if which == "logp" else h).sum().backward()
    xo = logits.double().requires_grad_(True)
    lp_o, h_o = oracle(xo, t, temperature=0.8)
    (lp_o if which == "logp" else h_o).sum().backward()
    close(x.grad, xo.grad, 1e-5)


def test_compute_entropy_false():
    logits, t, ul, _ = make_inputs((10,), vocab=19)
    x = logits.clone().requires_grad_(True)
    lp, h = vocab_parallel_logprobs_entropy(x, t, compute_entropy=False, chunk_tokens=4)
    assert h is None
    (lp * ul.float()).sum().backward()
    xo = logits.double().requires_grad_(True)
    lp_o, _ = oracle(xo, t)
    (lp_o * ul).sum().backward()
    close(lp, lp_o, 1e-5)
    close(x.grad, xo.grad, 1e-5)


def test_no_grad_and_input_not_mutated():
    logits, t, _, _ = make_inputs((7,), vocab=12)
    before = logits.clone()
    with torch.no_grad():
        lp, h = vocab_parallel_logprobs_entropy(logits, t, temperature=2.0, chunk_tokens=2)
    assert torch.equal(logits, before)  # fp32 .float() aliases: we must copy the chunk
    close(lp, oracle(logits, t, temperature=2.0)[0], 1e-5)


# ----------------------------------------------------------------------------- chunking
def test_chunk_sizes_give_same_result():
    args = make_inputs((21,), vocab=37)
    ref = run_ours(*args, chunk_tokens=21)
    lp_o, h_o, g_o = run_oracle(*args)
    close(ref[0], lp_o, 1e-5)
    close(ref[2], g_o, 1e-5)
    for chunk in (1, 3, 7, 20, 21, 64):  # divides 21 or not, larger than T
        out = run_ours(*args, chunk_tokens=chunk)
        for a, b in zip(out, ref):
            # Bitwise identical: every per-token result depends only on its own row, and
            # these rows are far too short for the kernels to split a row's reduction.
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_empty_input():
    x = torch.zeros(0, 3, 10, requires_grad=True)
    lp, h = vocab_parallel_logprobs_entropy(x, torch.zeros(0, 3, dtype=torch.long))
    assert lp.shape == (0, 3) and h.shape == (0, 3) and lp.dtype == torch.float32
    (lp.sum() + h.sum()).backward()
    assert x.grad.shape == x.shape


# ----------------------------------------------------------------------------- padding / temperature
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_padding_is_ignored(dtype):
    true_v, padded_v = 29, 32
    logits, t, ul, ue = make_inputs((2, 6), vocab=true_v, dtype=dtype)
    pad = torch.full((2, 6, padded_v - true_v), 50.0, dtype=dtype)  # would dominate the softmax
    padded = torch.cat([logits, pad], dim=-1)
    lp_p, h_p, g_p = run_ours(padded, t, ul, ue, vocab_size=true_v, chunk_tokens=5)
    lp_u, h_u, g_u = run_ours(logits, t, ul, ue, chunk_tokens=5)
    torch.testing.assert_close(lp_p, lp_u, atol=1e-6, rtol=0)
    torch.testing.assert_close(h_p, h_u, atol=1e-6, rtol=0)
    torch.testing.assert_close(g_p[..., :true_v], g_u, atol=1e-6, rtol=0)
    assert torch.all(g_p[..., true_v:] == 0)
    lp_o, h_o, _ = run_oracle(padded, t, ul, ue, vocab_size=true_v)
    close(lp_p, lp_o, 1e-5)
    close(h_p, h_o, 1e-5)


@pytest.mark.parametrize("temperature", [0.35, 1.7])
def test_temperature(temperature):
    args = make_inputs((12,), vocab=26)
    lp, h, g = run_ours(*args, temperature=temperature, chunk_tokens=5)
    lp_o, h_o, g_o = run_oracle(*args, temperature=temperature)
    close(lp, lp_o, 1e-5)
    close(h, h_o, 1e-5)
    close(g, g_o, 1e-5)
    lp_n, h_n = naive_logprobs_entropy(args[0], args[1], temperature=temperature)
    close(lp, lp_n, 1e-5)
    close(h, h_n, 1e-5)


# ----------------------------------------------------------------------------- errors
def test_errors():
    x = torch.randn(4, 10)
    t = torch.tensor([0, 3, 5, 7])
    f = vocab_parallel_logprobs_entropy
    with pytest.raises(ValueError, match="shape"):
        f(x, t[:3])
    with pytest.raises(ValueError, match="integer"):
        f(x, t.float())
    with pytest.raises(ValueError, match="temperature"):
        f(x, t, temperature=0.0)
    with pytest.raises(ValueError, match="temperature"):
        f(x, t, temperature=-1.0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        f(x, t, chunk_tokens=0)
    with pytest.raises(ValueError, match="floating-point"):
        f(x.long(), t)
    bad = t.clone()
    bad[2] = 8
    with pytest.raises(ValueError, match="target id 8"):
        f(x, bad, vocab_size=8)  # id 8 falls into padding
    bad[2] = 12
    with pytest.raises(ValueError, match="target id 12"):
        f(x, bad)  # beyond the whole (unsharded) vocab
    bad[2] = -3
    with pytest.raises(ValueError, match="target id -3"):
        f(x, bad)


# ----------------------------------------------------------------------------- tensor parallel
# (full padded vocab, true vocab size or None, temperature, chunk)
TP_CASES = [
    (40, None, 1.0, 4),  # 2 x 20, no padding
    (40, 37, 1.3, 3),  # last shard partly padding
    (40, 15, 0.7, 64),  # last shard entirely padding
]
TP_DTYPES = [torch.float32, torch.bfloat16]


def _tp_worker(rank, world, port):
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        torch.set_num_threads(1)
        for dtype in TP_DTYPES:
            for padded_v, vocab_size, temp, chunk in TP_CASES:
                # Same seed on every rank -> identical full inputs; each rank keeps its shard.
                logits, t, ul, ue = make_inputs((3, 5), padded_v, dtype=dtype, target_vocab=vocab_size)
                shard = padded_v // world
                lo = rank * shard
                local = logits[..., lo:lo + shard]
                lp, h, g = run_ours(local, t, ul, ue, vocab_start=lo, vocab_size=vocab_size,
                                    group=dist.group.WORLD, chunk_tokens=chunk, temperature=temp)
                # Single-process, full-vocab reference (ours) and float64 oracle.
                lp_r, h_r, g_r = run_ours(logits, t, ul, ue, vocab_size=vocab_size,
                                          chunk_tokens=chunk, temperature=temp)
                lp_o, h_o, g_o = run_oracle(logits, t, ul, ue, vocab_size=vocab_size, temperature=temp)
                shards = [torch.empty_like(g) for _ in range(world)]
                dist.all_gather(shards, g.contiguous())
                g_full = torch.cat(shards, dim=-1)
                gtol = 1e-5 if dtype == torch.float32 else 1e-2
                tag = f"dtype={dtype} case={(padded_v, vocab_size, temp, chunk)} rank={rank}"
                for a, b, tol in [(lp, lp_r, 1e-5), (h, h_r, 1e-5), (g_full, g_r, gtol),
                                  (lp, lp_o, 1e-5), (h, h_o, 1e-5), (g_full, g_o, gtol)]:
                    torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol, msg=lambda m: f"{tag}: {m}")
                if vocab_size is not None:
                    assert torch.all(g_full[..., vocab_size:] == 0), tag
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_tensor_parallel_two_ranks_matches_single_process():
    # One spawn for all TP cases: process start-up dominates the cost.
    mp.spawn(_tp_worker, args=(2, free_port()), nprocs=2, join=True)


# ----------------------------------------------------------------------------- benchmark smoke
def test_benchmark_quick_runs():
    proc = subprocess.run(
        python_command(REPO / "benchmarks" / "logprobs.py", "--quick", preloaded=True, children=True),
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ratio ours/naive" in proc.stdout, proc.stdout
