"""`megatron-rl smoke`: a forward/backward check of the policy alone, no rollout engine, in seconds
(a new machine, a new layout or a new model: does Megatron build, pack, compute logprobs and step?).

Builds the configured policy (by default the tiny Qwen3-MoE preset), packs a few synthetic
variable-length samples into token-budget micro-batches, computes per-token logprobs and
entropy, and takes a few optimizer steps on the token-mean negative log-likelihood of the
"response" tokens, normalized over the whole step. Metrics go to OUTPUT_DIR/metrics.jsonl.
It runs the same on one CPU process or under torchrun with any parallel layout.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from megatron_rl.config import RunConfig
from megatron_rl.errors import ConfigError
from megatron_rl.model.packing import pack_by_token_budget
from megatron_rl.algorithms import compute_step_normalizer
from megatron_rl.model.policy import Policy
from megatron_rl.runtime import start_runtime


def synthetic_samples(vocab_size: int, count: int, seed: int, dp_rank: int, dp_size: int):
    """Deterministic samples; each DP rank takes every dp_size-th one."""
    generator = torch.Generator().manual_seed(seed)
    samples, prompts = [], []
    for index in range(count):
        length = int(torch.randint(16, 96, (1,), generator=generator))
        prompt = int(torch.randint(4, length // 2, (1,), generator=generator))
        tokens = torch.randint(0, vocab_size, (length,), generator=generator).tolist()
        if index % dp_size == dp_rank:
            samples.append(tokens)
            prompts.append(prompt)
    return samples, prompts


def refuse_a_training_run(out: Path) -> None:
    """The smoke run appends its rows (step 1, 2, ...) to OUTPUT_DIR/metrics.jsonl: in a training
    run's directory they would join that run's curve and the rows its resume checks."""
    from megatron_rl.train.run_lock import LOCK

    held = [name for name in ("run.json", "run_state.json", LOCK, "checkpoints") if (out / name).exists()]
    if held:
        raise ConfigError(f"output_dir {out} is a training run's directory (it holds {', '.join(held)}): the smoke "
                          "run would append its rows to that run's metrics.jsonl; pass another --output-dir "
                          "(default: runs/smoke)")


def run_smoke(config: RunConfig, steps: int = 5, num_samples: int = 16) -> list[dict]:
    if steps < 1:  # before the runtime and the model: a run of no steps would still report "done"
        raise ConfigError(f"--steps must be >= 1 (forward/backward steps of the smoke run), got {steps}")
    refuse_a_training_run(Path(config.output_dir))
    started = time.time()
    runtime = start_runtime(config)
    try:
        policy = Policy(config, runtime)
        arch = policy.arch
        if runtime.is_driver:
            experts = f", {arch.num_experts} experts top-{arch.moe_top_k}" if arch.is_moe else ""
            print(
                f"policy: {arch.architecture} ({arch.num_layers} layers, hidden {arch.hidden_size}{experts}), "
                f"{config.model.precision}, tp={config.parallel.tp} pp={config.parallel.pp} "
                f"ep={config.parallel.ep} dp={runtime.dp_size}, device {runtime.device}, "
                f"{'Transformer Engine' if policy.use_te else 'local'} layers",
                flush=True,
            )
        samples, prompts = synthetic_samples(arch.vocab_size, num_samples, config.seed, runtime.dp_rank, runtime.dp_size)
        batches = pack_by_token_budget(samples, prompts, config.micro_batch_tokens, policy.pad_to_multiple)
        normalizer = compute_step_normalizer([b.loss_mask for b in batches], group=policy.dp_group, device=runtime.device).num_tokens

        def loss_fn(logprobs, entropy, batch):
            mask = batch.loss_mask[0]
            metrics = {"entropy_sum": (entropy.detach() * mask).sum()} if entropy is not None else {}
            return -(logprobs * mask).sum() / normalizer, metrics

        output_dir = Path(config.output_dir)
        if runtime.is_driver:
            output_dir.mkdir(parents=True, exist_ok=True)
        records = []
        for step in range(1, steps + 1):
            tick = time.time()
            result = policy.train_step(batches, loss_fn)
            record = {
                "step": step,
                "train/loss": result.loss,
                "train/grad_norm": result.grad_norm,
                "train/tokens": int(normalizer),
                "time/step_s": round(time.time() - tick, 3),
            }
            records.append(record)
            if runtime.is_driver:
                print(f"step {step}/{steps}  loss {result.loss:.4f}  grad-norm {result.grad_norm:.4f}  "
                      f"({record['time/step_s']:.2f}s)", flush=True)
                with open(output_dir / "metrics.jsonl", "a") as handle:
                    handle.write(json.dumps(record) + "\n")
        if runtime.is_driver:
            print(f"smoke run done in {time.time() - started:.1f}s; metrics in {output_dir / 'metrics.jsonl'}")
        return records
    finally:
        runtime.shutdown()
