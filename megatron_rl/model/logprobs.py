"""Per-token log-probabilities and entropy from (vocab-parallel) logits, in bounded memory.

Why this exists
---------------
RL post-training needs, for every generated token, ``log p(y_t)`` (policy-gradient /
importance ratios / KL) and often the entropy ``H_t`` of the token distribution. The
obvious implementation, ``torch.log_softmax(logits.float(), -1)`` followed by a gather,
materializes an fp32 copy of the whole ``[tokens x vocab]`` logits: for 4096 tokens and a
151936-entry vocabulary that is 4096 * 151936 * 4 B = 2.5 GB, autograd keeps that
log-softmax (and ``p`` for the entropy) alive until backward, and backward creates
same-sized fp32 gradients again before casting back to the input dtype. With
tensor-parallel vocab sharding the naive route is worse still, since it must gather the
vocabulary onto every rank first.

What this does instead
----------------------
* The vocabulary is never gathered. Each rank reduces its own shard to per-token scalars
  (max, sum of exp, target logit, sum of ``p * z``) and only those ``O(tokens)`` vectors are
  all-reduced over the tensor-parallel group: one MAX and one SUM for the whole call,
  independent of the number of chunks (local stats are combined with an "online softmax"
  rescaling, so the global max is not needed while streaming over the logits).
* Tokens are processed ``chunk_tokens`` at a time and only the current chunk is upcast to
  fp32. Forward saves the input logits as given (a reference, no copy), the targets and
  two fp32 scalars per token (logsumexp and the expected logit ``E_p[z]``); backward
  recomputes the chunk's softmax and writes the local-shard gradient straight into one
  buffer of the logits' dtype.

Memory bound (beyond the inputs): two fp32 work buffers of ``[chunk_tokens x V_local]``
(the upcast logits and ``exp``/``p``; both are needed at once for ``sum p * z``), reused
by every chunk, plus, in backward, the gradient buffer ``[tokens x V_local]`` in the input
dtype (which the naive version also produces), plus a few fp32 vectors of length
``tokens``. For 4096 x 151936 bf16 with chunk_tokens=1024: 2 x 0.6 GB + 1.2 GB, vs ~12 GB
for the naive version (measured by benchmarks/logprobs.py). Halving ``chunk_tokens``
halves the fp32 part. Compute is entirely fp32 regardless of the input dtype.

Logits are assumed finite; padding columns must be described via ``vocab_size``, not by
writing ``-inf`` into the logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

__all__ = ["vocab_parallel_logprobs_entropy", "naive_logprobs_entropy"]


def _all_reduce(tensor: torch.Tensor, op, group) -> None:
    # group=None means "this process holds the whole vocabulary": no communication at all.
    # (Deliberately different from torch.distributed, where group=None means WORLD.)
    if group is not None and tensor.numel() > 0 and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def _chunk_buffers(rows: int, cols: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    # Two fp32 work buffers reused by every chunk (the last, shorter chunk uses a view):
    # this is the whole fp32 footprint, and reusing them avoids re-faulting fresh pages
    # for each chunk (allocations this large go straight to mmap/munmap on CPU).
    return (torch.empty(rows, cols, dtype=torch.float32, device=device),
            torch.empty(rows, cols, dtype=torch.float32, device=device))


class _VocabParallelLogprobsEntropy(torch.autograd.Function):
    """logits2d [N, V_local] (any float dtype), targets [N] int64 -> (logp [N], entropy [N] | None)."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, n_valid, group, chunk, temperature, compute_entropy):
        n_tokens = logits.shape[0]
        dev = logits.device
        f32 = dict(dtype=torch.float32, device=dev)
        # Local (this shard only) per-token statistics, each relative to the LOCAL max m_r:
        #   s_r = sum_j exp(z_j - m_r),  t_r = sum_j exp(z_j - m_r) * (z_j - m_r)
        # Working with shifted logits keeps t_r (and hence the entropy) well conditioned
        # even when logits are large: H = log s - t / s with both terms O(1).
        local_max = torch.full((n_tokens,), float("-inf"), **f32)
        sum_exp = torch.zeros(n_tokens, **f32)
        sum_exp_z = torch.zeros(n_tokens, **f32)
        target_logit = torch.zeros(n_tokens, **f32)  # 0 for targets owned by other ranks

        local_t = targets - vocab_start
        in_shard = (local_t >= 0) & (local_t < n_valid)

        if n_valid > 0 and n_tokens > 0:  # a shard made only of padding contributes nothing
            z_buf, p_buf = _chunk_buffers(min(chunk, n_tokens), n_valid, dev)
            for s in range(0, n_tokens, chunk):
                e = min(s + chunk, n_tokens)
                # Upcast only this chunk; padding columns are simply sliced away (== -inf).
                z = z_buf[: e - s].copy_(logits[s:e, :n_valid])  # a copy: never mutate the input
                if temperature != 1.0:
                    z.div_(temperature)
                rows_in = in_shard[s:e]
                idx = local_t[s:e].clamp(0, n_valid - 1).unsqueeze(1)
                target_logit[s:e] = torch.where(rows_in, z.gather(1, idx).squeeze(1), 0.0)
                m = z.amax(dim=1)
                local_max[s:e] = m
                z.sub_(m.unsqueeze(1))  # z <- z - m_r (<= 0)
                p = torch.exp(z, out=p_buf[: e - s])
                sum_exp[s:e] = p.sum(dim=1)
                if compute_entropy:
                    sum_exp_z[s:e] = p.mul_(z).sum(dim=1)
            del z_buf, p_buf, z, p  # free the fp32 work buffers before the reductions below

        # Combine shards. Only per-token scalars cross the wire.
        global_max = local_max.clone()
        _all_reduce(global_max, dist.ReduceOp.MAX, group)
        scale = torch.exp(local_max - global_max)  # 0 for empty shards (m_r = -inf)
        shift = torch.where(sum_exp > 0, local_max - global_max, 0.0)  # avoid (-inf) * 0
        # Re-express local sums relative to the global max, then add across ranks:
        #   sum exp(z - M) = scale * s_r
        #   sum exp(z - M) (z - M) = scale * (t_r + (m_r - M) * s_r)
        stats = torch.stack([scale * sum_exp, scale * (sum_exp_z + shift * sum_exp), target_logit])
        _all_reduce(stats, dist.ReduceOp.SUM, group)
        s_glob, t_glob, z_target = stats.unbind(0)

        log_s = torch.log(s_glob)
        logsumexp = global_max + log_s
        logprobs = (z_target - global_max) - log_s
        if compute_entropy:
            mean_shifted = t_glob / s_glob  # E_p[z - M]
            entropy = log_s - mean_shifted
            expected_z = global_max + mean_shifted  # E_p[z], needed by the entropy gradient
        else:
            entropy = expected_z = None

        ctx.set_materialize_grads(False)  # unused outputs -> grad None -> skip their work
        ctx.save_for_backward(logits, targets, logsumexp, expected_z)
        ctx.cfg = (vocab_start, n_valid, chunk, temperature)
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_ent):
        logits, targets, logsumexp, expected_z = ctx.saved_tensors
        vocab_start, n_valid, chunk, temperature = ctx.cfg
        n_tokens = logits.shape[0]
        nones = (None,) * 7
        if n_tokens == 0 or n_valid == 0 or (grad_logp is None and grad_ent is None):
            return torch.zeros_like(logits, memory_format=torch.contiguous_format), *nones
        # Gradient of the local shard, in the logits' dtype. Real columns are fully written
        # below; padding columns are excluded from the softmax, so their grad is exactly 0.
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        grad[:, n_valid:].zero_()

        # No communication here: logsumexp and E_p[z] were all-reduced in forward, so they
        # are already the GLOBAL statistics, and p_j = exp(z_j - logsumexp) is exact for the
        # local columns. Each rank only writes the gradient of its own shard.
        #
        # With z = logits / T, p = softmax(z):
        #   d logp_y / dz_j = [j == y] - p_j
        #   d H      / dz_j = -p_j (z_j - E_p[z])
        # so dL/dz_j = -p_j * (g_logp + g_H * (z_j - E_p[z])) + [j == y] * g_logp,
        # and dL/dlogits = dL/dz / T.
        inv_t = 1.0 / temperature
        local_t = targets - vocab_start
        in_shard = (local_t >= 0) & (local_t < n_valid)
        z_buf, p_buf = _chunk_buffers(min(chunk, n_tokens), n_valid, logits.device)
        for s in range(0, n_tokens, chunk):
            e = min(s + chunk, n_tokens)
            z = z_buf[: e - s].copy_(logits[s:e, :n_valid])
            if temperature != 1.0:
                z.div_(temperature)
            p = torch.sub(z, logsumexp[s:e].unsqueeze(1), out=p_buf[: e - s]).exp_()
            if grad_ent is not None:
                # g = -(g_H (z - E[z]) + g_logp) / T * p, built in place in z's buffer.
                g = z.sub_(expected_z[s:e].unsqueeze(1)).mul_((-inv_t * grad_ent[s:e]).unsqueeze(1))
                if grad_logp is not None:
                    g.sub_((inv_t * grad_logp[s:e]).unsqueeze(1))
                g.mul_(p)
            else:
                g = p.mul_((-inv_t * grad_logp[s:e]).unsqueeze(1))
            if grad_logp is not None:
                # One-hot term, only for targets living in this shard (others add 0 at a
                # clamped dummy column; scatter_add avoids a host sync on GPU).
                idx = local_t[s:e].clamp(0, n_valid - 1).unsqueeze(1)
                val = torch.where(in_shard[s:e], inv_t * grad_logp[s:e], 0.0).unsqueeze(1)
                g.scatter_add_(1, idx, val)
            grad[s:e, :n_valid] = g  # cast to the logits' dtype on write
        return grad, *nones


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    group: "dist.ProcessGroup | None" = None,
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
    compute_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of ``target_ids`` and entropy of ``softmax(logits / temperature)``.

    Args:
        logits: ``[..., V_local]``, this rank's vocabulary shard (bf16/fp16/fp32).
        target_ids: ``[...]`` integer GLOBAL vocab ids, same leading shape as ``logits``.
        vocab_start: global id of this shard's first column.
        vocab_size: true (unpadded) vocab size; columns with global id >= vocab_size are
            padding and excluded from the softmax. None = no padding.
        group: tensor-parallel group over which the vocab is sharded; None = ``logits``
            hold the whole vocabulary (no communication, unlike torch.distributed's
            None = WORLD). All ranks of the group must call this with the same tokens.
        chunk_tokens: tokens upcast to fp32 at a time (memory/speed knob).
        temperature: logits are divided by it before the softmax.
        compute_entropy: if False, the entropy is skipped and returned as None.

    Returns:
        ``(logprobs, entropy)``, fp32 with shape ``[...]``; entropy is None if not computed.
        Both are differentiable w.r.t. ``logits``.
    """
    if not torch.is_tensor(logits) or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got {getattr(logits, 'dtype', type(logits))}")
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (the vocab shard)")
    if tuple(target_ids.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"target_ids shape {tuple(target_ids.shape)} must equal logits shape without the "
            f"vocab dim {tuple(logits.shape[:-1])}"
        )
    if target_ids.is_floating_point() or target_ids.is_complex() or target_ids.dtype == torch.bool:
        raise ValueError(f"target_ids must be an integer tensor, got dtype {target_ids.dtype}")
    if not temperature > 0:  # also rejects NaN
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if vocab_start < 0:
        raise ValueError(f"vocab_start must be >= 0, got {vocab_start}")
    if vocab_size is not None and vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")

    lead_shape = logits.shape[:-1]
    v_local = logits.shape[-1]
    n_tokens = target_ids.numel()
    targets = target_ids.reshape(n_tokens).to(torch.long)

    # Global id bound for validation: known from vocab_size, or from the logits when this
    # process holds the whole vocab. (Under TP without vocab_size it is unknown.)
    upper = vocab_size if vocab_size is not None else (vocab_start + v_local if group is None else None)
    if n_tokens > 0:
        lo, hi = (x.item() for x in torch.aminmax(targets))  # one cheap reduction, one sync
        if lo < 0:
            raise ValueError(f"target id {lo} is negative")
        if upper is not None and hi >= upper:
            raise ValueError(f"target id {hi} is out of range for vocab_size {upper}")

    # Number of real (non-padding) columns in this shard.
    n_valid = v_local if vocab_size is None else max(0, min(v_local, vocab_size - vocab_start))

    logp, ent = _VocabParallelLogprobsEntropy.apply(
        logits.reshape(n_tokens, v_local), targets, vocab_start, n_valid, group,
        chunk_tokens, float(temperature), compute_entropy,
    )
    logp = logp.reshape(lead_shape)
    ent = ent.reshape(lead_shape) if ent is not None else None
    return logp, ent


def naive_logprobs_entropy(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    vocab_size: int | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: full-vocab, single-process, fp32 ``log_softmax`` + gather + entropy.

    Memory-hungry on purpose (it is the baseline): materializes fp32 ``[tokens x V]``
    log-probs and probabilities, and autograd keeps them for backward.
    """
    z = logits.float()
    if vocab_size is not None:
        z = z[..., :vocab_size]
    logp_all = torch.log_softmax(z / temperature, dim=-1)
    logp = logp_all.gather(-1, target_ids.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
