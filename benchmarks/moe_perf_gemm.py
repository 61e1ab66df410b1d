"""Phase A of benchmarks/moe_perf.py: Transformer Engine's GroupedLinear alone, in one process.

    python benchmarks/moe_perf_gemm.py --jsonl OUT.jsonl [--deadline-s 90]
    python benchmarks/moe_perf_gemm.py --jsonl OUT.jsonl --dry-run   # CPU: the pipeline, no TE figures

Qwen3-30B-A3B's expert linears, fc1 2048 -> 1536 (gate and up, 2 x 768) and fc2 768 -> 2048, BF16
forward + backward, at the (experts x tokens per expert) one GPU sees: 128 x {341, 1024, 2048} (EP1:
3, 1 or half a micro-batch of 16,384 tokens), 16 x {2048, 8192} (EP8), 8 x 4096 (EP16); each with
TE's cuBLAS path (one GEMM per expert on 4 streams) and its SM90 CUTLASS grouped kernel
(NVTE_USE_CUTLASS_GROUPED_GEMM, read per call), fused weight-gradient accumulation (into FP32
main_grad, as Megatron's DDP does) off and on. Per case, over --iters iterations after warm-up:

  host ms     the time the Python call takes to enqueue one forward + backward (GPU queue empty)
  GPU ms      CUDA events around each iteration on the stream: the GPU's wall time, gaps included
  graph ms    the same forward + backward captured once in a CUDA graph and replayed: no host
              work, the kernels alone (the ceiling; a capture TE refuses is recorded with its error)
  TFLOP/s     6 x rows x K x N (forward, data gradient, weight gradient) / the time

Each case appends one JSON line to --jsonl as it ends. --dry-run (no GPU, no TE) records every case
as "needs Transformer Engine" and, so that the timing and TFLOP/s arithmetic runs, times a
pure-torch per-expert reference of each shape at a tiny size on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

LINEARS = {"fc1": (2048, 1536), "fc2": (768, 2048)}  # (K in, N out)
SHAPES = [(128, 341), (128, 1024), (128, 2048), (16, 2048), (16, 8192), (8, 4096)]  # (experts, tokens per expert)
BACKENDS = ("cublas", "cutlass")
# The dry run's reference: experts, tokens and widths divided by these (at least 1).
TINY = {"experts": 32, "tokens": 64, "width": 16}


def cases() -> list[dict]:
    """cuBLAS first: CUTLASS copies from pageable host memory, so its graph capture may fail, and a
    failed capture must not come before the cases that can be captured."""
    return [{"phase": "A", "case": f"{linear} {experts}x{tokens} {backend} wgrad-{'fused' if fused else 'apart'}",
             "linear": linear, "experts": experts, "tokens_per_expert": tokens, "backend": backend, "fused_wgrad": fused}
            for backend in BACKENDS for experts, tokens in SHAPES for linear in LINEARS for fused in (False, True)]


def gemm_flops(experts: int, tokens_per_expert: int, k: int, n: int) -> int:
    """Forward, data gradient and weight gradient: three GEMMs of 2 x rows x K x N each."""
    return 6 * experts * tokens_per_expert * k * n


def tflops(flops: float, seconds: float | None) -> float | None:
    return flops / seconds / 1e12 if seconds else None


def append(path: str, row: dict) -> None:
    with open(path, "a") as out:  # one line per case, flushed as it ends: a kill keeps what finished
        out.write(json.dumps(row) + "\n")


# ------------------------------------------------------------------------------------------------
# On the GPU: te.GroupedLinear
# ------------------------------------------------------------------------------------------------


def grouped_linear(case: dict):
    import transformer_engine.pytorch as te

    k, n = LINEARS[case["linear"]]
    experts, tokens = case["experts"], case["tokens_per_expert"]
    layer = te.GroupedLinear(experts, k, n, bias=False, params_dtype=torch.bfloat16, device="cuda",
                             fuse_wgrad_accumulation=case["fused_wgrad"])
    if case["fused_wgrad"]:
        for i in range(experts):
            weight = getattr(layer, f"weight{i}")
            weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32, device="cuda")
    x = torch.randn(experts * tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(experts * tokens, n, device="cuda", dtype=torch.bfloat16)
    splits = [tokens] * experts

    def step():
        layer(x, splits).backward(grad)

    return layer, x, step


def measure_te(case: dict, iters: int) -> dict:
    os.environ["NVTE_USE_CUTLASS_GROUPED_GEMM"] = "1" if case["backend"] == "cutlass" else "0"
    os.environ["NVTE_CUTLASS_GROUPED_GEMM_WARN_FALLBACK"] = "1"  # a fallback to cuBLAS is logged
    layer, x, step = grouped_linear(case)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    host, events = [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()  # an empty queue: the host time is the enqueue alone
        start.record()
        tick = time.perf_counter()
        step()
        host.append(time.perf_counter() - tick)
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    row = {"host_s": sum(host) / iters, "gpu_s": sum(s.elapsed_time(e) for s, e in events) / iters / 1e3}
    row.update(graph_replay(step, iters))
    return row


def graph_replay(step, iters: int) -> dict:
    """The same forward + backward captured in a CUDA graph, replayed `iters` times (CUDA events)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream before capture (torch's rule)
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return {"graph_s": start.elapsed_time(end) / iters / 1e3}
    except Exception as exc:  # TE or the backend refused the capture: recorded, the next case runs
        return {"graph_s": None, "graph_error": f"{type(exc).__name__}: {str(exc)[:300]}"}


# ------------------------------------------------------------------------------------------------
# The dry run: a pure-torch reference at a tiny size
# ------------------------------------------------------------------------------------------------


def reference_shape(case: dict) -> tuple[int, int, int, int]:
    k, n = LINEARS[case["linear"]]
    return (max(1, case["experts"] // TINY["experts"]), max(1, case["tokens_per_expert"] // TINY["tokens"]),
            max(1, k // TINY["width"]), max(1, n // TINY["width"]))


def measure_reference(case: dict, iters: int) -> dict:
    """Per-expert torch matmuls, forward + backward, on the CPU (host time = its wall time)."""
    experts, tokens, k, n = reference_shape(case)
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=generator, requires_grad=True) for _ in range(experts)]
    x = torch.randn(experts * tokens, k, generator=generator, requires_grad=True)
    grad = torch.randn(experts * tokens, n, generator=generator)

    def step():
        out = torch.cat([chunk @ w.t() for chunk, w in zip(x.split(tokens), weights)])
        out.backward(grad)

    step()
    tick = time.perf_counter()
    for _ in range(iters):
        step()
    seconds = (time.perf_counter() - tick) / iters
    flops = gemm_flops(experts, tokens, k, n)
    return {"reference": f"pure torch on CPU, {experts} x {tokens} tokens, {k} -> {n}", "reference_flops": flops,
            "reference_s": seconds, "reference_tflops": tflops(flops, seconds)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jsonl", required=True, help="append one line per case here")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--deadline-s", type=float, default=float("inf"), help="start no case after this many seconds")
    parser.add_argument("--dry-run", action="store_true", help="CPU: no TE; a pure-torch reference at a tiny size")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA GPU is visible; on a CPU machine run with --dry-run")
    started, references = time.perf_counter(), {}
    for case in cases():
        if time.perf_counter() - started > args.deadline_s:
            append(args.jsonl, {**case, "status": f"not run: past the phase's {args.deadline_s:g} s"})
            continue
        tick = time.perf_counter()
        k, n = LINEARS[case["linear"]]
        row = {**case, "flops": gemm_flops(case["experts"], case["tokens_per_expert"], k, n)}
        if args.dry_run:
            # The backends and wgrad fusion are TE's; the reference is the same for all four of a shape.
            key = (case["linear"], case["experts"], case["tokens_per_expert"])
            if key not in references:
                references[key] = measure_reference(case, args.iters)
            row.update(status="needs Transformer Engine", **references[key])
        else:
            try:
                row.update(measure_te(case, args.iters), status="measured")
            except Exception as exc:  # recorded; the next case runs
                row.update(status="error", error=f"{type(exc).__name__}: {str(exc)[:300]}")
            for what in ("host", "gpu", "graph"):
                row[f"{what}_tflops"] = tflops(row["flops"], row.get(f"{what}_s"))
        row["seconds"] = time.perf_counter() - tick
        append(args.jsonl, row)
        print(f"A {row['case']}: {row['status']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
