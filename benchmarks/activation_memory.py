#!/usr/bin/env python
"""The planner's activation estimate (megatron_rl/plan/activations.py) against real CPU steps.

    python benchmarks/activation_memory.py [--out benchmarks/results/activation_memory_cpu.md]

For each model size of two families (Qwen3-MoE: MoE layers, GQA; DeepSeek-V3: multi-latent attention,
a dense first layer, MoE layers with a shared expert; one process, fp32, a packed micro-batch of
2048 tokens) one real forward + backward runs in a process of its own (tests/plan/activation_worker.py)
and reports its peak resident memory above the state before it, the bytes autograd saved, and the
estimate. glibc gives every block of 64 KiB or more its own mapping (MALLOC_MMAP_THRESHOLD_), so a
freed tensor leaves the resident set and the peak is live memory. The error is estimate / peak - 1.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests/plan"))
sys.path.insert(0, str(REPO / "tests"))
SIZES = [(256, 2, "none", "qwen3-moe"), (256, 4, "none", "qwen3-moe"), (512, 2, "none", "qwen3-moe"),
         (512, 4, "none", "qwen3-moe"), (256, 4, "full", "qwen3-moe"), (512, 4, "full", "qwen3-moe"),
         (256, 2, "none", "deepseek-v3"), (512, 4, "none", "deepseek-v3"), (512, 4, "full", "deepseek-v3")]


def main() -> int:
    from test_activation_estimate import run_step

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/activation_memory_cpu.md"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for hidden, layers, recompute, family in SIZES:
            r = run_step(Path(work), hidden, layers, recompute, family)
            r["error"] = r["estimate_bytes"] / r["peak_bytes"] - 1
            rows.append(r)
            print(f"{family} hidden {hidden} layers {layers} recompute {recompute}: estimate {r['estimate_bytes'] / 2**20:.0f} MiB "
                  f"vs peak {r['peak_bytes'] / 2**20:.0f} MiB ({r['error']:+.1%})", flush=True)
    lines = ["# Activation estimate vs real CPU steps", "",
             f"`python benchmarks/activation_memory.py` on {platform.processor() or platform.machine()}, "
             "one process, fp32, a packed micro-batch of 2048 tokens (4 samples), vocabulary 8000 (8064 padded). "
             "qwen3-moe: 4 experts top-2, GQA 4/2 heads; deepseek-v3: MLA with 4 heads (latent ranks hidden/2), "
             "a dense first layer, then 8 routed experts top-2 + 1 shared.", "",
             "| family | hidden | layers | parameters | recompute | saved by autograd MiB | peak MiB | estimate MiB | error |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['hidden']} | {r['layers']} | {r['parameters']:,} | {r['recompute']} | "
                     f"{r['saved_bytes'] / 2**20:.0f} | {r['peak_bytes'] / 2**20:.0f} | "
                     f"{r['estimate_bytes'] / 2**20:.0f} | {r['error']:+.1%} |")
    lines += ["", "Peak: VmHWM above the resident set before the step (clear_refs), with every block of 64 KiB "
              "or more in its own mapping. The estimate is of the peak (the saved activations plus the "
              "logits' gradient and the loss's chunk buffers when the backward starts); the local layer "
              "spec's attention copies (padded length buckets) are included here, as `attention=\"cpu\"`, "
              "and left out for GPUs (Transformer Engine's fused attention keeps no such copies)."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
