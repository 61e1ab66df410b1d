"""Shared test material for megatron_rl.algorithms: random step batches, the list of loss
configurations every invariance test runs, and an independent float64 oracle.

The oracle is written from the papers' formulas with explicit Python loops over samples and
tokens (no masks, no weights tensors, no shared code with the package), so agreement with it
checks the vectorized implementation rather than restating it.
"""

from __future__ import annotations

import math

import torch

from megatron_rl.algorithms import LOSS_AGG_MODES, PolicyLossConfig, off_policy_keep


# ----------------------------------------------------------------------------- data
def make_step(batch=7, seq=9, seed=0, dtype=torch.float64, lengths=None, noise=0.3, per_token_adv=False):
    """A whole optimizer step: per-token inputs [batch, seq] with varied lengths.

    Lengths include a 1-token sample and, by default, one empty row (a fully masked sample).
    Old/ref/rollout logprobs differ from the current ones by ``noise`` so ratios spread
    across both clip boundaries.
    """
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = [seq, 1, 5, 0, 7, 3, seq - 1][:batch]
        lengths += [int(x) for x in torch.randint(1, seq + 1, (batch - len(lengths),), generator=g)]
    mask = torch.zeros(batch, seq, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    lp = -torch.rand(batch, seq, generator=g, dtype=torch.float64) * 3 - 0.05
    data = {
        "logprobs": lp,
        "old_logprobs": lp + noise * rnd(batch, seq),
        "ref_logprobs": lp + noise * rnd(batch, seq),
        "rollout_logprobs": lp + noise * rnd(batch, seq),
        "entropy": rnd(batch, seq).abs() + 0.1,
        "advantages": rnd(batch, seq) if per_token_adv else rnd(batch),
        "mask": mask,
    }
    # Padding holds garbage on purpose: it must never reach the loss or the gradient.
    for k in ("logprobs", "old_logprobs", "ref_logprobs", "rollout_logprobs", "entropy"):
        data[k] = torch.where(mask, data[k], torch.full_like(data[k], float("nan")))
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in data.items()}


def split_rows(data, sizes, trim=True):
    """Split a step into micro-batches of whole samples (row counts ``sizes``); each micro-batch
    is trimmed to its own longest sample, so micro-batches have different widths."""
    assert sum(sizes) == data["mask"].shape[0]
    out, start = [], 0
    for n in sizes:
        part = {k: v[start:start + n] for k, v in data.items()}
        if trim:
            width = max(int(part["mask"].sum(-1).max()) if n else 0, 1)
            part = {k: (v[:, :width] if v.dim() == 2 else v) for k, v in part.items()}
        out.append(part)
        start += n
    return out


# ----------------------------------------------------------------------------- configurations
def config_cases():
    """(id, PolicyLossConfig) covering every aggregation mode x ratio level x surrogate, with the
    regularizers and TIS variants rotated through them, plus bare configs."""
    variants = [("ppo", "token"), ("ppo", "sequence"), ("ppo", "sequence_token"), ("cispo", "token")]
    kl_types = ["k1", "k2", "k3", "k3+"]
    # TIS, a two-sided sequence mask, IcePop, TIS with a floor, none, MIS token, MIS sequence:
    # every aggregation mode meets at least two masking corrections.
    tis = [("token", "truncate", 1.3, None), ("sequence", "mask", 2.5, 0.4), ("token", "mask", 1.2, 0.8),
           ("sequence", "truncate", 1.5, 0.7), (None, "truncate", 2.0, None), ("token", "mask", 1.3, None),
           ("sequence", "mask", 3.0, None)]
    cases, k = [], 0
    for mode in LOSS_AGG_MODES:
        for loss_type, level in variants:
            tis_level, tis_mode, up, lo = tis[k % len(tis)]
            kw = dict(
                policy_loss_type=loss_type, ratio_level=level, loss_agg_mode=mode,
                eps_low=0.2 if loss_type == "ppo" else 1.0, eps_high=0.28,
                kl_coef=0.05, kl_loss_type=kl_types[k % 4], entropy_coef=0.01,
                tis_level=tis_level, tis_mode=tis_mode, tis_upper=up, tis_lower=lo,
                l_norm=12.0 if (mode == "seq-mean-token-sum-norm" and k % 2) else None,
                opsm_delta=0.05 if k % 3 == 1 else None,  # DeepSeek-V3.2's sequence mask, in every mode
            )
            if loss_type == "ppo" and k % 2 == 0:
                kw["dual_clip_c"] = 1.2
            if k % 3 == 0:
                kw["log_ratio_clamp"] = 0.25  # active on some tokens: clamped entries get no gradient
            cases.append((f"{mode}|{loss_type}|{level}|{k}", PolicyLossConfig(**kw)))
            k += 1
    for mode in LOSS_AGG_MODES:
        cases.append((f"{mode}|bare", PolicyLossConfig(loss_agg_mode=mode)))
    return cases


def loss_inputs(part, cfg):
    """Keyword arguments for policy_loss from a (micro-)batch dict, only what the config uses."""
    kw = {"ref_logprobs": part["ref_logprobs"] if cfg.kl_coef > 0 else None,
          "rollout_logprobs": part["rollout_logprobs"] if cfg.tis_level or cfg.opsm_delta is not None else None,
          "entropy": part["entropy"] if cfg.entropy_coef else None}
    return kw


def kept_masks(parts, cfg, cp_group=None):
    """The masks a step's normaliser counts: each micro-batch's loss mask less the tokens the
    off-policy corrections drop (pi_theta at the update's start = the parts' logprobs)."""
    return [off_policy_keep(p["mask"], cfg, old_logprobs=p["old_logprobs"], rollout_logprobs=p["rollout_logprobs"],
                            advantages=p["advantages"], logprobs=p["logprobs"], cp_group=cp_group) for p in parts]


# ----------------------------------------------------------------------------- float64 oracle
def _kl(lp, ref, kind, cin, cout):
    x = lp - ref
    if cin is not None:
        x = x.clamp(-cin, cin)

    def out(v):
        return v if cout is None else v.clamp(-cout, cout)

    if kind == "k1":
        return out(x)
    if kind == "k2":
        return out(x * x / 2)
    k3 = torch.exp(ref - lp if cin is None else -x) - 1 + x  # pi_ref/pi - log(pi_ref/pi) - 1
    if kind == "k3":
        return out(k3)
    k2 = x * x / 2
    return k2 - k2.detach() + out(k3).detach()


def oracle_kept(data, cfg: PolicyLossConfig):
    """The tokens that stay in the loss, per sample, from the papers' definitions (float64 loops):
    a masking importance weight (IcePop / MIS) outside [lower, upper] drops the token, or (sequence
    level) all the sample's tokens; DeepSeek-V3.2's sequence mask drops a token whose advantage is
    negative when 1/|o_i| sum_t (log mu - log pi_theta) over its sample exceeds delta."""
    mask = data["mask"]
    kept = []
    for i in range(mask.shape[0]):
        toks = [t for t in range(mask.shape[1]) if mask[i, t]]
        mu = {t: float(data["rollout_logprobs"][i, t]) for t in toks} if toks and cfg.masks_tokens else {}
        seq_lw = sum(float(data["old_logprobs"][i, t]) - mu[t] for t in toks) if mu else 0.0
        kl = sum(mu[t] - float(data["logprobs"][i, t].detach()) for t in toks) / len(toks) if mu else 0.0
        row = []
        for t in toks:
            a = float(data["advantages"][i, t] if data["advantages"].dim() == 2 else data["advantages"][i])
            if cfg.tis_level and cfg.tis_mode == "mask":
                lw = float(data["old_logprobs"][i, t]) - mu[t] if cfg.tis_level == "token" else seq_lw
                lo = cfg.tis_lower if cfg.tis_lower is not None else 0.0
                if not lo <= math.exp(lw) <= cfg.tis_upper:
                    continue
            if cfg.opsm_delta is not None and a < 0 and kl > cfg.opsm_delta:
                continue
            row.append(t)
        kept.append(row)
    return kept


def oracle_loss(data, cfg: PolicyLossConfig):
    """Full-step loss from the papers' formulas, sample by sample, token by token (float64).
    Masked tokens (oracle_kept) leave every count: N_tokens, |o_i|, N_seqs, the longest sample."""
    lp_all, old_all = data["logprobs"].double(), data["old_logprobs"].double()
    mask, adv_all = data["mask"], data["advantages"].double()
    kept = oracle_kept(data, cfg)
    lens = [len(row) for row in kept]
    samples = [i for i, n in enumerate(lens) if n > 0]
    n_tok, n_seq = sum(lens), len(samples)
    l_norm = cfg.l_norm if cfg.l_norm is not None else max(lens)
    total = lp_all.new_zeros(())
    for i in samples:
        toks = kept[i]
        seq_lr = sum(lp_all[i, t] - old_all[i, t] for t in toks) / len(toks)
        every = [t for t in range(mask.shape[1]) if mask[i, t]]  # the sequence weight: all its tokens
        seq_tis = sum(old_all[i, t] - data["rollout_logprobs"][i, t].double() for t in every) if cfg.tis_level else None
        for t in toks:
            lp, old = lp_all[i, t], old_all[i, t]
            a = adv_all[i, t] if adv_all.dim() == 2 else adv_all[i]
            if cfg.ratio_level == "token":
                lr = lp - old
            elif cfg.ratio_level == "sequence":
                lr = seq_lr
            else:
                lr = lp - lp.detach() + seq_lr.detach()
            if cfg.log_ratio_clamp is not None:
                lr = lr.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
            r = torch.exp(lr)
            r_clip = r.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
            if cfg.policy_loss_type == "ppo":
                term = torch.maximum(-a * r, -a * r_clip)
                if cfg.dual_clip_c is not None and a < 0:
                    term = torch.minimum(term, -a * cfg.dual_clip_c)
            else:
                term = -r_clip.detach() * a * lp
            if cfg.tis_level:
                lw = (old - data["rollout_logprobs"][i, t].double()) if cfg.tis_level == "token" else seq_tis
                w = math.exp(float(lw))
                lo = cfg.tis_lower if cfg.tis_lower is not None else 0.0
                if cfg.tis_mode == "truncate":
                    w = min(max(w, lo), cfg.tis_upper)
                else:
                    w = w if lo <= w <= cfg.tis_upper else 0.0
                term = term * w
            if cfg.kl_coef > 0:
                term = term + cfg.kl_coef * _kl(lp, data["ref_logprobs"][i, t].double(), cfg.kl_loss_type,
                                                cfg.kl_input_clamp, cfg.kl_output_clamp)
            if cfg.entropy_coef:
                term = term - cfg.entropy_coef * data["entropy"][i, t].double()
            weight = {
                "token-mean": 1 / n_tok,
                "seq-mean-token-mean": 1 / (n_seq * len(toks)),
                "seq-mean-token-sum": 1 / n_seq,
                "seq-mean-token-sum-norm": 1 / (n_seq * l_norm),
                "token-sum": 1.0,
            }[cfg.loss_agg_mode]
            total = total + weight * term
    return total


def grads_of(fn, data, keys=("logprobs", "entropy")):
    """Run fn(inputs) -> loss with fresh leaf copies of ``keys``; return (loss, {key: grad})."""
    leaves = {k: data[k].detach().clone().requires_grad_(True) for k in keys}
    loss = fn({**data, **leaves})
    loss.backward()
    return loss.detach(), {k: (v.grad if v.grad is not None else torch.zeros_like(v)) for k, v in leaves.items()}


def max_rel_err(a, b):
    """max |a - b| / max |b|; inf if ``a`` (the implementation's value) has any NaN/inf."""
    a, b = a.double(), b.double()
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    scale = max(b.abs().max().item(), 1e-30)
    return (a - b).abs().max().item() / scale
