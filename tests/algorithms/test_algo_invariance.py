"""Every loss mode against the float64 oracle, and the central contract: the gradient of a step
does not depend on how its samples are split into micro-batches or across DP / CP ranks.

Single-process: 1, 2 and 3 uneven micro-batches (each trimmed to its own width). Multi-process:
2 real gloo ranks as data parallel (samples split) and as context parallel (every sample's
tokens split), with micro-batches on each rank. Metrics combined with reduce_metrics must equal
the full-batch metrics too.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _algo_cases import (config_cases, grads_of, kept_masks, loss_inputs, make_step, max_rel_err, oracle_loss,
                         split_rows)
from _support.processes import free_port
from megatron_rl.algorithms import compute_step_normalizer, policy_loss, reduce_metrics

pytestmark = pytest.mark.multiprocess

CASES = config_cases()
SPLITS = [[7], [3, 4], [1, 4, 2]]
TOL = 1e-9  # float64 throughout: any normalization slip shows up as O(1) relative error


def full_step(data, cfg):
    """Loss, gradients and metrics of the whole step in one call (normalizer=None)."""
    box = {}

    def fn(d):
        loss, metrics = policy_loss(d["logprobs"], d["old_logprobs"], d["advantages"], d["mask"], cfg,
                                    **loss_inputs(d, cfg))
        box["metrics"] = metrics
        return loss

    loss, grads = grads_of(fn, data)
    return loss, grads, reduce_metrics([box["metrics"]])


def split_step(parts, cfg, normalizer, cp_group=None):
    """Sum of micro-batch losses; per-part gradients; the list of metric dicts."""
    total, grads, metric_list = 0.0, [], []
    for part in parts:
        box = {}

        def fn(d):
            loss, metrics = policy_loss(d["logprobs"], d["old_logprobs"], d["advantages"], d["mask"], cfg,
                                        normalizer=normalizer, cp_group=cp_group, **loss_inputs(d, cfg))
            box["metrics"] = metrics
            return loss

        loss, g = grads_of(fn, part)
        total += loss.item()
        grads.append(g)
        metric_list.append(box["metrics"])
    return total, grads, metric_list


def reassemble(grads, key, width):
    """Per-part gradients [n_k, w_k] -> [sum n_k, width] (zeros beyond each part's width)."""
    rows = []
    for g in grads:
        x = g[key]
        rows.append(torch.nn.functional.pad(x, (0, width - x.shape[1])))
    return torch.cat(rows)


def assert_metrics_equal(got, want, tag):
    assert set(got) == set(want), f"{tag}: metric keys differ: {set(got) ^ set(want)}"
    for k in want:
        assert abs(got[k] - want[k]) <= TOL * max(1.0, abs(want[k])), f"{tag}: {k} {got[k]} != {want[k]}"


@pytest.mark.parametrize("per_token_adv", [False, True], ids=["adv_per_sample", "adv_per_token"])
@pytest.mark.parametrize("case_id,cfg", CASES, ids=[c[0] for c in CASES])
def test_oracle_and_microbatch_invariance(case_id, cfg, per_token_adv):
    data = make_step(per_token_adv=per_token_adv, seed=len(case_id))
    loss, grads, metrics = full_step(data, cfg)

    # 1) Float64 re-derivation: value and autograd gradients equal the loop oracle.
    o_loss, o_grads = grads_of(lambda d: oracle_loss(d, cfg), data)
    assert abs(loss.item() - o_loss.item()) <= 1e-12 * max(1.0, abs(o_loss.item())), (loss, o_loss)
    for key in ("logprobs", "entropy"):
        assert max_rel_err(grads[key], o_grads[key]) <= 1e-10, key
    assert grads["logprobs"].abs().sum() > 0  # the case exercises a real gradient

    # 2) Any split into whole-sample micro-batches gives the same step.
    for sizes in SPLITS:
        parts = split_rows(data, sizes)
        norm = compute_step_normalizer(kept_masks(parts, cfg), cfg.loss_agg_mode, cfg.l_norm)
        total, part_grads, metric_list = split_step(parts, cfg, norm)
        assert abs(total - loss.item()) <= TOL * max(1.0, abs(loss.item())), (sizes, total, loss)
        for key in ("logprobs", "entropy"):
            err = max_rel_err(reassemble(part_grads, key, data["mask"].shape[1]), grads[key])
            assert err <= TOL, (sizes, key, err)
        assert_metrics_equal(reduce_metrics(metric_list), metrics, f"split {sizes}")


def test_float32_inputs_match_float64_oracle():
    """fp32 inputs: the loss is computed in fp32 and agrees with the float64 oracle to fp32 accuracy."""
    for case_id, cfg in CASES[::3]:
        data32 = make_step(dtype=torch.float32, seed=3)
        data64 = {k: (v.double() if v.is_floating_point() else v) for k, v in data32.items()}
        loss, grads, _ = full_step(data32, cfg)
        assert loss.dtype == torch.float32, case_id
        o_loss, o_grads = grads_of(lambda d: oracle_loss(d, cfg), data64)
        assert abs(loss.item() - o_loss.item()) <= 1e-5 * max(1.0, abs(o_loss.item())), case_id
        assert max_rel_err(grads["logprobs"], o_grads["logprobs"]) <= 1e-5, case_id
        # fp32 micro-batch split: same gradient to fp32 rounding.
        parts = split_rows(data32, [2, 5])
        norm = compute_step_normalizer(kept_masks(parts, cfg), cfg.loss_agg_mode, cfg.l_norm)
        _, part_grads, _ = split_step(parts, cfg, norm)
        assert max_rel_err(reassemble(part_grads, "logprobs", 9), grads["logprobs"]) <= 1e-6, case_id


def test_per_microbatch_normalization_would_fail():
    """Mutation check of the test itself: normalizing each micro-batch by its own counts (the
    classic token-mean bug) changes the gradient, so the invariance assertions above can fail."""
    cfg = CASES[0][1]
    data = make_step()
    _, grads, _ = full_step(data, cfg)
    parts = split_rows(data, [3, 4])
    wrong = []
    for part in parts:
        _, g = grads_of(lambda d: policy_loss(d["logprobs"], d["old_logprobs"], d["advantages"], d["mask"], cfg,
                                              **loss_inputs(d, cfg))[0], part)
        wrong.append(g)
    assert max_rel_err(reassemble(wrong, "logprobs", 9), grads["logprobs"]) > 0.1


# ----------------------------------------------------------------------------- real gloo ranks
def _worker(rank, world, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        group = dist.group.WORLD
        for per_token_adv in (False, True):
            for case_id, cfg in CASES:
                data = make_step(per_token_adv=per_token_adv, seed=len(case_id))
                loss, grads, metrics = full_step(data, cfg)  # single-process reference, on every rank
                tag = f"{case_id} adv_per_token={per_token_adv} rank={rank}"

                # Data parallel: rank 0 holds samples 0-2 (micro-batches of 1 and 2), rank 1 holds
                # samples 3-6 (micro-batches of 3 and 1).
                rows = [(0, 3), (3, 7)][rank]
                local = {k: v[rows[0]:rows[1]] for k, v in data.items()}
                parts = split_rows(local, [[1, 2], [3, 1]][rank])
                norm = compute_step_normalizer(kept_masks(parts, cfg), cfg.loss_agg_mode, cfg.l_norm, group=group)
                total, part_grads, metric_list = split_step(parts, cfg, norm)
                summed = torch.tensor([total], dtype=torch.float64)
                dist.all_reduce(summed)
                assert abs(summed.item() - loss.item()) <= TOL * max(1.0, abs(loss.item())), tag
                for key in ("logprobs", "entropy"):
                    err = max_rel_err(reassemble(part_grads, key, 9), grads[key][rows[0]:rows[1]])
                    assert err <= TOL, (tag, "dp", key, err)
                assert_metrics_equal(reduce_metrics(metric_list, group=group), metrics, tag + " dp")

                # Context parallel: every rank holds every sample, rank 0 tokens 0-3, rank 1 tokens
                # 4-8 (so short samples live entirely on rank 0); two micro-batches per rank.
                cols = [(0, 4), (4, 9)][rank]
                local = {k: (v[:, cols[0]:cols[1]] if v.dim() == 2 else v) for k, v in data.items()}
                parts = split_rows(local, [3, 4], trim=False)
                norm = compute_step_normalizer(kept_masks(parts, cfg, group), cfg.loss_agg_mode, cfg.l_norm,
                                               group=group, cp_group=group)
                total, part_grads, metric_list = split_step(parts, cfg, norm, cp_group=group)
                summed = torch.tensor([total], dtype=torch.float64)
                dist.all_reduce(summed)
                assert abs(summed.item() - loss.item()) <= TOL * max(1.0, abs(loss.item())), tag + " cp"
                for key in ("logprobs", "entropy"):
                    got = torch.cat([g[key] for g in part_grads])
                    err = max_rel_err(got, grads[key][:, cols[0]:cols[1]])
                    assert err <= TOL, (tag, "cp", key, err)
                assert_metrics_equal(reduce_metrics(metric_list, group=group), metrics, tag + " cp")

        # Ranks disagreeing on the metric keys is detected on every rank, not silently mixed.
        keys = {"count/tokens/sum": 1.0, ("a/x/tok_sum" if rank == 0 else "a/y/tok_sum"): 1.0}
        try:
            reduce_metrics([keys], group=group)
        except ValueError as e:
            assert "different metric keys" in str(e)
        else:
            raise AssertionError("mismatched metric keys were not detected")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_two_gloo_ranks_dp_and_cp_match_single_process():
    # One spawn for every case and both layouts: process start-up dominates the cost.
    mp.spawn(_worker, args=(2, free_port()), nprocs=2, join=True)
