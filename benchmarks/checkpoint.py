#!/usr/bin/env python
"""How long the training loop is blocked per checkpoint: synchronous vs asynchronous save.

    python benchmarks/checkpoint.py [--saves 3] [--quick] [--out results.md]

One process builds the policy of a MoE model whose training state (fp32 weights and Adam's two
moments) is >= 500 MB (benchmarks/rollout.py's ~61M-parameter model: ~0.7 GB), takes real
optimizer steps on packed samples, and checkpoints with the trainer's own code
(megatron_rl.checkpoint.store.begin_save), alternating modes:

  synchronous   the loop waits for begin_save, which returns once the checkpoint is published
  asynchronous  the loop waits for begin_save (gather, planning, fork), then trains on while the
                forked writer writes; at each following step boundary it polls (a collective and,
                once the writer is done, the finalization: metadata, manifest, rename, `latest`)

Blocked time = begin_save + every poll until published. The ratio asynchronous / synchronous is
printed (goal: <= 0.2) with the write time, the CRC-32 time against it, and the training step
time with and without a write in flight (the writer shares the CPU with training). Each
checkpoint is verified (checksums) after it is published. --quick: the tiny default model, to
check the script runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
GOAL = 0.2


def build(work: Path, quick: bool):
    from megatron_rl.config import load_config
    from megatron_rl.model.policy import Policy
    from megatron_rl.runtime import start_runtime

    overrides = ["device=cpu", f"output_dir={work / 'run'}", "logging.wandb_mode=disabled"]
    if not quick:
        from rollout import model_config  # benchmarks/rollout.py

        (work / "model").mkdir()
        (work / "model" / "config.json").write_text(json.dumps(model_config(quick=False)))
        overrides.append(f"model.hf_config={work / 'model'}")
    config = load_config(None, overrides)
    runtime = start_runtime(config)
    return config, runtime, Policy(config, runtime, total_steps=1000)


def make_update(policy, runtime):
    import torch

    from megatron_rl.algorithms import compute_step_normalizer
    from megatron_rl.model.packing import pack_by_token_budget

    generator = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, policy.arch.vocab_size, (96,), generator=generator).tolist() for _ in range(8)]
    batches = pack_by_token_budget(samples, [32] * len(samples), 512, policy.pad_to_multiple)
    normalizer = compute_step_normalizer([b.loss_mask for b in batches], group=policy.dp_group,
                                         device=runtime.device).num_tokens

    def loss_fn(logprobs, entropy, batch):
        return -(logprobs * batch.loss_mask[0]).sum() / normalizer, {}

    return lambda: policy.train_step(batches, loss_fn)


def state_bytes(policy) -> int:
    params = sum(p.numel() for p in policy.module.parameters())
    return params * 4 * 3  # fp32 weights + Adam's two moments


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--saves", type=int, default=3, help="checkpoints per mode")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")

    from megatron_rl.observability.console import quiet_dependencies

    quiet_dependencies()
    from megatron_rl.checkpoint import store as ckpt

    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    config, runtime, policy = build(work, args.quick)
    update = make_update(policy, runtime)
    update()  # Adam's state exists
    size = state_bytes(policy)
    print(f"model: {sum(p.numel() for p in policy.module.parameters()) / 1e6:.1f}M parameters, "
          f"training state {size / 2**20:.0f} MiB (fp32 weights + 2 moments)")

    def train_steps(count: int) -> list[float]:
        times = []
        for _ in range(count):
            tick = time.perf_counter()
            update()
            times.append(time.perf_counter() - tick)
        return times

    quiet_steps = train_steps(3)
    results = {"sync": [], "async": []}
    busy_steps = []
    step = 0
    # The first save of a process starts Megatron-Core's result-queue manager process (seconds):
    # one untimed save per mode first.
    for round_ in range(args.saves + 1):
        for mode in ("sync", "async"):
            step += 1
            root = work / f"checkpoints_{mode}"
            pending = ckpt.begin_save(root, step, policy, {"note": "benchmark"}, keep_last=1, keyed_like_weights={},
                                      metadata={}, hf_files={}, async_save=mode == "async", device=runtime.device)
            while pending.process is not None and not pending.stats.path:
                tick = time.perf_counter()
                update()
                if round_:
                    busy_steps.append(time.perf_counter() - tick)
                pending.poll(blocking=False)
            stats = pending.stats
            problem = ckpt.verify(stats.path)
            assert problem is None, f"{stats.path}: {problem}"
            if round_ == 0:
                continue
            results[mode].append(stats)
            print(f"{mode:5s} save {step}: blocked {stats.blocked_s:.3f} s, wrote {stats.bytes / 2**20:.0f} MiB in "
                  f"{stats.write_s:.2f} s, CRC-32 {stats.checksum_s:.3f} s")

    def median(mode: str, key: str) -> float:
        return statistics.median(getattr(s, key) for s in results[mode])

    ratio = median("async", "blocked_s") / median("sync", "blocked_s")
    crc_share = median("sync", "checksum_s") / median("sync", "write_s")
    lines = [
        f"training state: {size / 2**20:.0f} MiB; {args.saves} saves per mode, medians",
        f"synchronous:  training blocked {median('sync', 'blocked_s'):.3f} s per save (write {median('sync', 'write_s'):.2f} s)",
        f"asynchronous: training blocked {median('async', 'blocked_s'):.3f} s per save (write {median('async', 'write_s'):.2f} s, in the background)",
        f"CRC-32 of every file: {median('sync', 'checksum_s'):.3f} s per save = {crc_share:.1%} of the write time",
        f"training step: {statistics.median(quiet_steps):.3f} s alone, {statistics.median(busy_steps):.3f} s "
        f"with a write in flight ({len(busy_steps)} steps)" if busy_steps else "training step: no step overlapped a write",
        f"ratio asynchronous/synchronous blocked time: {ratio:.3f} (goal <= {GOAL}: {'met' if ratio <= GOAL else 'GOAL MISSED'})",
    ]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("# Checkpoint save: time the training loop is blocked\n\n"
                                  "`python benchmarks/checkpoint.py" + (" --quick" if args.quick else "") +
                                  f" --saves {args.saves}`, one CPU process.\n\n```\n" + "\n".join(lines) + "\n```\n")
    runtime.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
