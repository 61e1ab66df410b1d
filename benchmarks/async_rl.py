"""Asynchronous RL against the synchronous loop: wall time per RL step and held-out accuracy.

The same `megatron-rl train` run (the built-in tiny task, server engines) with rl.max_staleness
0 (synchronous: generate, score, train, push, in turn), 1 and 2 (the engines generate the next
steps' samples while the trainer trains). Like is compared with like: one vLLM CPU server pinned
to one core serves every variant, and every trainer run is pinned to the other core (one
OpenMP thread), the synchronous baseline included; each run pushes its own weights first. The
run is sized so that generation and training take comparable time (printed from the
synchronous run's own phase timings), which bounds the possible gain at 0.5x.

Reported per variant: median wall time per RL step (from the metrics log's elapsed time, the
first step and the final evaluation step left out), its ratio to the synchronous run measured
in the same invocation, held-out accuracy before RL (after the identical warm start) and after
the same number of steps, and the largest staleness seen. Goal: at most 0.7x the synchronous
step time with the learning kept.

    python benchmarks/async_rl.py                  # ~15 min on 2 CPU cores, a quiet machine
    python benchmarks/async_rl.py --steps 12 --warm-start 100   # a quicker look
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TRAINER_CORE, SERVER_CORE = 0, 1


def start_server(root: Path):
    """The vLLM server on its own core (the affinity is inherited by its processes)."""
    from megatron_rl.config import load_config
    from megatron_rl.rollout.engine_model import write_engine_model_dir
    from megatron_rl.rollout.engines.vllm_server import VllmServerProcess

    write_engine_model_dir(load_config(), root / "model")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    everywhere = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {SERVER_CORE})
    try:
        return VllmServerProcess.start(root / "model", port=port, log_path=root / "vllm.log", load_format="dummy")
    finally:
        os.sched_setaffinity(0, everywhere)


def train(out: Path, url: str, staleness: int, args) -> dict[int, dict]:
    command = [sys.executable, "-m", "megatron_rl.cli", "train", "--output-dir", str(out),
               "rollout.mode=server", f"rollout.server_urls=[{url}]", "rollout.weight_transport=files",
               f"rollout.staging_dir={out.parent / 'staging'}", f"rl.max_staleness={staleness}",
               f"rl.steps={args.steps}", "rl.eval_every=0", f"rl.prompts_per_step={args.prompts}",
               f"rl.max_response_tokens={args.max_tokens}", f"warm_start.steps={args.warm_start}",
               f"micro_batch_tokens={args.micro_batch_tokens}", f"rl.updates_per_rollout={args.updates}",
               "checkpoint.every_steps=0", "checkpoint.export_hf=false", "logging.wandb_mode=disabled"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    result = subprocess.run(command, env=env, capture_output=True, text=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, {TRAINER_CORE}))
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in records}


def summarize(records: dict[int, dict], steps: int) -> dict:
    # Step s's wall time: elapsed between its record and the previous one. Step 1 includes the
    # producer's first batch (nothing to overlap yet); the last step includes the evaluation.
    walls = [records[s]["elapsed_s"] - records[s - 1]["elapsed_s"] for s in range(2, steps)]
    phases = {key: statistics.median(records[s].get(key, 0.0) for s in range(2, steps))
              for key in ("time/generate_s", "time/score_s", "time/logprobs_s", "time/train_s", "time/sync_s",
                          "time/wait_rollout_s", "time/wait_push_s")}
    return {"step_s": statistics.median(walls), "accuracy_before": records[0]["eval/accuracy"],
            "accuracy_after": records[steps]["eval/accuracy"], "phases": phases,
            "staleness_max": max(records[s].get("rollout/staleness_max", 0) for s in range(1, steps + 1))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warm-start", type=int, default=250)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=6)
    # Training is sized up to generation's time with smaller micro-batches and more updates per
    # rollout (the tiny model trains a step in ~0.1 s otherwise, a tenth of its generation).
    parser.add_argument("--micro-batch-tokens", type=int, default=256)
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--staleness", default="0,1,2", help="variants; 0 (the reference) is always run")
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs two cores: one for the trainer, one for the server")
    variants = sorted({0, *(int(k) for k in args.staleness.split(","))})
    results = {}
    with tempfile.TemporaryDirectory(prefix="async-rl-") as tmp:
        root = Path(tmp)
        server = start_server(root)
        try:
            for staleness in variants:
                records = train(root / f"k{staleness}", server.url, staleness, args)
                results[staleness] = summarize(records, args.steps)
                print(f"max_staleness={staleness}: {results[staleness]['step_s']:.2f} s/step", flush=True)
        finally:
            server.stop()

    sync = results[0]
    phases = sync["phases"]
    generate = phases["time/generate_s"] + phases["time/score_s"]
    train_s = phases["time/logprobs_s"] + phases["time/train_s"]
    print(f"\nsynchronous step, median phases: generate+score {generate:.2f} s, logprobs+train {train_s:.2f} s, "
          f"push {phases['time/sync_s']:.2f} s  (generation / training = {generate / max(train_s, 1e-9):.2f})")
    print(f"{'max_staleness':>13} {'s/step':>7} {'ratio':>6} {'acc before':>10} {'acc after':>9} {'staleness max':>13}")
    for staleness, r in results.items():
        r["ratio"] = r["step_s"] / sync["step_s"]
        print(f"{staleness:>13} {r['step_s']:>7.2f} {r['ratio']:>5.2f}x {r['accuracy_before']:>10.3f} "
              f"{r['accuracy_after']:>9.3f} {r['staleness_max']:>13}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
