"""Benchmark: chunked vocab-parallel logprobs/entropy vs naive ``log_softmax(logits.float())``.

Usage::

    python benchmarks/logprobs.py [--tokens 4096 --vocab 151936 --dtype bf16 --chunk 1024]
    python benchmarks/logprobs.py --quick        # 512 x 32000 smoke run

Both variants run forward + backward of ``loss = logp.sum() + 0.01 * entropy.sum()`` on the
same logits (single process, ``group=None``) and are compared on peak extra memory, wall
time (median over ``--repeats``) and max abs difference of the outputs.

How memory is measured (CPU): each variant runs in a FRESH subprocess, so allocator caches
and the other variant's peak cannot leak into its number. Inside it, the inputs are created
first (in place, without an fp32 temporary), then the kernel's peak-RSS counter is reset by
writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0), which sets ``VmHWM`` to the
current RSS; after the runs, ``VmHWM - RSS_at_reset`` is the peak memory used on top of the
inputs, sampled by the kernel itself (no sampling thread that could miss a short spike).
It includes the gradient buffer of the logits (input dtype), which both variants produce.
Large tensors are mmap-backed by glibc and returned to the OS when freed, so RSS tracks
live tensors closely. If ``clear_refs`` is not writable the script falls back to
``getrusage(RUSAGE_SELF).ru_maxrss`` minus its value after input creation (slightly
pessimistic for neither variant, but it cannot see below the input-creation peak).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Make the repo importable when run as `python benchmarks/logprobs.py` from anywhere.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron_rl.model.logprobs import naive_logprobs_entropy, vocab_parallel_logprobs_entropy  # noqa: E402
from peak_memory import PeakMemory  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MiB = 1024 * 1024


def worker(args) -> None:
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    logits = torch.empty(args.tokens, args.vocab, dtype=dtype)
    for s in range(0, args.tokens, 256):  # fill in place: no fp32 [T x V] temporary
        logits[s:s + 256].normal_().mul_(3.0)
    logits.requires_grad_(True)
    targets = torch.randint(0, args.vocab, (args.tokens,))

    if args.worker == "ours":
        def fn():
            return vocab_parallel_logprobs_entropy(logits, targets, chunk_tokens=args.chunk)
    else:
        def fn():
            return naive_logprobs_entropy(logits, targets)

    # Tiny warm-up of the same code path so one-time costs (lazy library/kernel init,
    # thread pools) are counted in neither the memory peak nor the timings.
    w = torch.randn(4, 64, dtype=dtype, requires_grad=True)
    for f in (vocab_parallel_logprobs_entropy, naive_logprobs_entropy):
        lp, en = f(w, torch.zeros(4, dtype=torch.long))
        (lp.sum() + 0.01 * en.sum()).backward()
    del w, lp, en

    mem = PeakMemory()
    mem.start()
    times = []
    for _ in range(args.repeats):
        logits.grad = None
        t0 = time.perf_counter()
        logp, ent = fn()
        (logp.sum() + 0.01 * ent.sum()).backward()
        times.append(time.perf_counter() - t0)
        logp, ent = logp.detach(), ent.detach()
    peak = mem.peak_bytes()
    torch.save({"logp": logp, "ent": ent}, args.out + ".pt")
    with open(args.out, "w") as f:
        json.dump({"peak": peak, "times": times, "method": mem.method}, f)


def run_variant(name: str, args, tmp: str) -> dict:
    out = os.path.join(tmp, name + ".json")
    cmd = [sys.executable, __file__, "--_worker", name, "--_out", out, "--tokens", str(args.tokens),
           "--vocab", str(args.vocab), "--dtype", args.dtype, "--chunk", str(args.chunk),
           "--repeats", str(args.repeats)]
    subprocess.run(cmd, check=True)
    with open(out) as f:
        res = json.load(f)
    res.update(torch.load(out + ".pt"))
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small smoke shape: 512 x 32000, chunk 128")
    p.add_argument("--_worker", dest="worker", choices=["ours", "naive"], help=argparse.SUPPRESS)
    p.add_argument("--_out", dest="out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.tokens, args.vocab, args.chunk = 512, 32000, 128
    if args.worker:
        return worker(args)

    with tempfile.TemporaryDirectory() as tmp:
        naive = run_variant("naive", args, tmp)
        ours = run_variant("ours", args, tmp)

    in_mib = args.tokens * args.vocab * DTYPES[args.dtype].itemsize / MiB
    print(f"shape {args.tokens} tokens x {args.vocab} vocab, {args.dtype} (logits {in_mib:.0f} MiB), "
          f"chunk {args.chunk}, {torch.get_num_threads()} threads, "
          f"loss = logp.sum() + 0.01 * entropy.sum(), fwd+bwd")
    print(f"memory: peak RSS above inputs via {ours['method']}, fresh process per variant")
    print(f"{'variant':<8} {'peak extra MiB':>15} {'median s':>9}   all runs (s)")
    for name, r in (("naive", naive), ("ours", ours)):
        runs = " ".join(f"{t:.2f}" for t in r["times"])
        print(f"{name:<8} {r['peak'] / MiB:>15.0f} {statistics.median(r['times']):>9.3f}   {runs}")
    mem_ratio = ours["peak"] / max(naive["peak"], 1)
    time_ratio = statistics.median(ours["times"]) / statistics.median(naive["times"])
    print(f"ratio ours/naive: peak memory {mem_ratio:.3f}, time {time_ratio:.3f}")
    print(f"max abs diff ours vs naive: logprobs {(ours['logp'] - naive['logp']).abs().max().item():.3e}, "
          f"entropy {(ours['ent'] - naive['ent']).abs().max().item():.3e}")


if __name__ == "__main__":
    main()
