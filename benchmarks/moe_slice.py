"""One GPU's compute in an EP=N layout of a MoE model, without the all-to-all: an upper bound.

    python benchmarks/moe_slice.py --ep 8 --json OUT.json                 # one GPU of EP8, Qwen3-30B-A3B shapes
    python benchmarks/moe_slice.py --ep 1 --json OUT.json                 # all 128 experts on one GPU
    python benchmarks/moe_slice.py --ep 8 --set model.moe_router_fusion=true --profile PREFIX ...
    python benchmarks/moe_slice.py --device cpu --peak-tflops 1 ...       # the same code on CPU (a dry run)

In an EP=N layout each GPU holds E/N of the E experts and, after the all-to-all, computes the rows
the whole EP group routed to them. With balanced routing a GPU that feeds T tokens per
micro-batch sends T x k rows out and receives T x k rows back, whatever N is, so

    tokens per local expert per micro-batch = T x k / (E / N)

(Qwen3-30B-A3B, E 128, k 8, T 16,384: 1,024 at EP1, 8,192 at EP8). One GPU of that layout is
emulated by a model with E/N experts, the same top-k and the same T per micro-batch: the same
FLOPs and GEMM shapes per token, expert weights and optimizer state at 1/N. What it leaves out
(the dispatch and combine all-to-all, the data-parallel gradient reduction, the full router's
E-wide gate GEMM, 0.3% of a layer's FLOPs) makes it an upper bound on one GPU's throughput in
that layout, and the report says so.

Routing is forced to balance as Megatron-Bridge's performance recipes do it: megatron-core's
`moe_router_force_load_balancing` (random router logits with a straight-through gradient; a
benchmark-only switch, set on the built model's TransformerConfig, not a config key). The
imbalance that remains is measured (max / mean tokens per expert over the timed steps).

Measured per run (after --warmup steps): seconds per step with the forward + backward and the
optimizer step apart, tokens/s, TFLOP/s, model MFU with and without the optimizer step (FLOPs as
in fp8_moe.py, of the emulated model), on CUDA the MoE layers' and the output head's time apart
(CUDA events), peak memory, and with --profile one more step under torch.profiler: the share of
the step the GPU is busy (the union of its kernels' intervals). The run's config levers come as
--set KEY=VALUE (e.g. model.gradient_accumulation_fusion=true). benchmarks/moe_perf.py runs it
once per case.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import fp8_moe  # noqa: E402

UPPER_BOUND = "one GPU's compute at EP {ep}, without the all-to-all: an upper bound"


def ep_layout(experts: int, ep: int, top_k: int, tokens_per_micro_batch: float) -> dict:
    """The share of an EP=`ep` layout one GPU computes, with balanced routing (module docstring)."""
    if ep < 1 or experts % ep:
        raise ValueError(f"--ep {ep} must divide the {experts} experts")
    local = experts // ep
    return {"ep": ep, "experts": experts, "local_experts": local, "top_k": top_k,
            "rows_per_micro_batch": tokens_per_micro_batch * top_k,
            "tokens_per_local_expert": tokens_per_micro_batch * top_k / local,
            "derivation": f"{tokens_per_micro_batch:,.0f} tokens x top-{top_k} / ({experts} experts / EP{ep}) = "
                          f"{tokens_per_micro_batch * top_k / local:,.0f} tokens per local expert per micro-batch"}


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels on several streams overlap)."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def kernel_intervals(profiler) -> list[tuple[float, float]]:
    """Seconds intervals of the device's kernels, copies and sets in a torch.profiler trace."""
    from torch.autograd import DeviceType

    return [(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in profiler.events()
            if e.device_type == DeviceType.CUDA]


def mfu(flops_per_s: float, peak_tflops: float | None) -> float | None:
    return flops_per_s / (peak_tflops * 1e12) if peak_tflops else None


class RoutingCounter:
    """Tokens per expert over the steps it is on: a forward hook per router adds its routing
    map's column sums on the device (no host sync until read)."""

    def __init__(self, module):
        self.counts, self.enabled = {}, True
        self.handles = [m.register_forward_hook(self._count) for m in module.modules()
                        if type(m).__name__ == "TopKRouter"]

    def _count(self, router, args, output):
        if self.enabled:
            counts = output[1].sum(dim=0).float()
            self.counts[id(router)] = self.counts[id(router)] + counts if id(router) in self.counts else counts

    def imbalance(self) -> float | None:
        """The largest max / mean tokens per expert over the routers (1.0: perfectly even)."""
        ratios = [float(c.max() / c.mean()) for c in self.counts.values() if float(c.mean()) > 0]
        return max(ratios) if ratios else None


def build_policy(args, hf: dict):
    from megatron_rl.config import load_config
    from megatron_rl.model.policy import Policy
    from megatron_rl.runtime import start_runtime

    config_dir = Path(tempfile.mkdtemp(prefix="moe-slice-"))
    (config_dir / "config.json").write_text(json.dumps(hf))
    overrides = [f"device={args.device}", f"model.hf_config={config_dir}", "model.precision=bf16",
                 f"micro_batch_tokens={args.micro_batch_tokens}", f"optimizer.lr={args.lr}", "optimizer.clip_grad=1.0",
                 "optimizer.adam_beta2=0.95", *args.set]  # the levers last: a --set of the same key wins
    config = load_config(None, overrides)
    runtime = start_runtime(config)
    try:
        policy = Policy(config, runtime)
    except Exception:
        runtime.shutdown()
        raise
    if args.balanced:
        policy.tconfig.moe_router_force_load_balancing = True  # every router reads this config object
        if args.device == "cpu":  # the forced logits draw from the CPU generator inside Megatron's RNG fork
            logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    return config, runtime, policy


def run(args) -> dict:
    from megatron_rl.algorithms import compute_step_normalizer
    from megatron_rl.model.packing import pack_by_token_budget

    cuda = args.device == "cuda"
    full = fp8_moe.model_config(args)
    layout = ep_layout(args.experts, args.ep, args.top_k, args.micro_batch_tokens)  # checks --ep first
    hf = {**full, "num_experts": layout["local_experts"]}
    config, runtime, policy = build_policy(args, hf)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    timer = fp8_moe.SplitTimer(policy.module) if cuda else None
    counter = RoutingCounter(policy.module)
    steps = fp8_moe.synthetic_steps(hf["vocab_size"], args.steps + bool(args.profile), args.tokens_per_step,
                                    args.min_len, args.max_len)
    rows = []
    for index, samples in enumerate(steps):
        batches = pack_by_token_budget(samples, [1] * len(samples), config.micro_batch_tokens, policy.pad_to_multiple)
        normalizer = compute_step_normalizer([b.loss_mask for b in batches], group=policy.dp_group,
                                             device=runtime.device).num_tokens

        def loss_fn(logprobs, entropy, batch):
            return -(logprobs * batch.loss_mask[0]).sum() / normalizer, {}

        profiled = bool(args.profile) and index == args.steps  # one more step after the timed ones
        counter.enabled = args.warmup <= index < args.steps
        with fp8_moe.profile_step(profiled) if cuda else _cpu_profile(profiled) as profiler:
            sync()
            tick = time.perf_counter()
            loss, _ = policy.forward_backward(batches, loss_fn)
            sync()
            middle = time.perf_counter()
            result = policy.optimizer_step(loss)
            sync()
            done = time.perf_counter()
        row = {"loss": loss, "seconds": done - tick, "optimizer_s": done - middle, "updated": result.updated,
               "flops": fp8_moe.step_flops(hf, [len(s) for s in samples]), "tokens": sum(map(len, samples)),
               "micro_batches": len(batches)}
        if timer:
            row["split"] = timer.take()
        if profiled:
            fp8_moe.write_profile(profiler, f"{args.profile}.txt")
            row["busy_s"] = busy_seconds(kernel_intervals(profiler)) if cuda else None
        rows.append(row)
        if not math.isfinite(loss):
            break
    report = summarize(args, hf, layout, rows, policy)
    report["micro_batch_tokens"] = config.micro_batch_tokens  # after the levers (one may set it)
    report["routing_imbalance"] = counter.imbalance()
    report["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    runtime.shutdown()
    return report


def _cpu_profile(enabled: bool):
    import contextlib

    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if enabled \
        else contextlib.nullcontext()


def summarize(args, hf: dict, layout: dict, rows: list[dict], policy) -> dict:
    """The timed steps' means and the figures derived from them (MFU against args.peak_tflops)."""
    profiled = [r for r in rows if "busy_s" in r]
    timed = [r for r in rows if "busy_s" not in r][args.warmup:] or rows[-1:]
    seconds = sum(r["seconds"] for r in timed)
    optimizer = sum(r["optimizer_s"] for r in timed)
    flops = sum(r["flops"] for r in timed)
    tokens = sum(r["tokens"] for r in timed)
    micro_batches = sum(r["micro_batches"] for r in timed) / len(timed)
    per_micro_batch = tokens / len(timed) / micro_batches
    report = {"upper_bound": UPPER_BOUND.format(ep=args.ep), "layout": ep_layout(args.experts, args.ep, args.top_k,
                                                                                 per_micro_batch),
              "model": hf, "set": args.set, "balanced_routing": args.balanced, "device": args.device,
              "losses": [r["loss"] for r in rows if "busy_s" not in r], "steps": len(rows) - len(profiled),
              "timed_steps": len(timed), "tokens_per_step": tokens / len(timed), "micro_batches_per_step": micro_batches,
              "tokens_per_micro_batch": per_micro_batch, "flops_per_step": flops / len(timed),
              "step_s": seconds / len(timed), "optimizer_s": optimizer / len(timed),
              "tokens_per_s": tokens / seconds, "tflops": flops / seconds / 1e12, "peak_tflops": args.peak_tflops,
              "mfu": mfu(flops / seconds, args.peak_tflops),
              "mfu_without_optimizer": mfu(flops / (seconds - optimizer), args.peak_tflops),
              "all_updated": all(r["updated"] for r in rows),
              "layers": "Transformer Engine" if policy.use_te else "local",
              "grouped_gemm": bool(policy.tconfig.moe_grouped_gemm)}
    if timed[0].get("split"):
        head = sum(fp8_moe.head_flops(hf, r["tokens"]) for r in timed)
        decoder_s = sum(r["split"]["decoder"] for r in timed)
        head_s = sum(r["split"]["head"] for r in timed)
        report["split"] = {"decoder_s": decoder_s / len(timed), "head_s": head_s / len(timed),
                           "decoder_mfu": mfu((flops - head) / decoder_s, args.peak_tflops),
                           "head_mfu": mfu(head / head_s, args.peak_tflops),
                           "head_share_of_flops": head / flops}
    if profiled:
        busy = profiled[0]["busy_s"]
        report["profile"] = {"step_s": profiled[0]["seconds"], "busy_s": busy,
                             "busy_share": busy / report["step_s"] if busy is not None else None,
                             "busy_share_of_profiled_step": busy / profiled[0]["seconds"] if busy is not None else None,
                             "table": f"{args.profile}.txt"}
    return report


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    shape = {"layers": 4, "hidden": 2048, "heads": 32, "kv_heads": 4, "head_dim": 128, "experts": 128, "top_k": 8,
             "expert_width": 768, "vocab": 151936}  # Qwen3-30B-A3B's shapes (48 layers in the full model)
    for name, default in shape.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    p.add_argument("--ep", type=int, default=1, help="emulate one GPU of this expert-parallel size")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--tokens-per-step", type=int, default=16384)
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--min-len", type=int, default=512)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--peak-tflops", type=float, help="the device's dense BF16 peak (default: from the GPU's name)")
    p.add_argument("--unbalanced", dest="balanced", action="store_false", help="the router's own routing")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (a lever)")
    p.add_argument("--profile", metavar="PREFIX", help="profile one more step into PREFIX.txt (GPU busy share)")
    p.add_argument("--json", required=True, help="write the report here")
    return p


def main() -> int:
    args = parser().parse_args()
    if not 0 <= args.warmup < args.steps:
        parser().error("--warmup must be smaller than --steps")
    if not 2 <= args.min_len <= args.max_len <= args.tokens_per_step:
        parser().error("need 2 <= --min-len <= --max-len <= --tokens-per-step")
    if args.device == "cuda":
        missing = fp8_moe.missing_requirements()
        if missing:
            parser().error(f"{'; '.join(missing)}: run with --device cpu for a dry run")
        args.peak_tflops = fp8_moe.peak_tflops(torch.cuda.get_device_name(0), args.peak_tflops)
    from megatron_rl.errors import ConfigError

    try:
        report = run(args)
    except ConfigError as exc:  # a lever this machine cannot run, refused by name before the model is built
        Path(args.json).write_text(json.dumps({"refused": str(exc)}))
        print(f"refused: {exc}")
        return 0
    report["versions"] = fp8_moe.versions()
    report["date"] = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    report["gpu"] = torch.cuda.get_device_name(0) if args.device == "cuda" else None
    Path(args.json).write_text(json.dumps(report, indent=1))
    mfu_text = f", model MFU {report['mfu']:.1%}" if report["mfu"] is not None else ""
    print(f"{report['upper_bound']}: {report['tokens_per_s']:,.0f} tokens/s, {report['tflops']:.1f} TFLOP/s{mfu_text}; "
          f"{report['layout']['derivation']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
