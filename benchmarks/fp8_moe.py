"""Benchmark: FP8 training recipes against BF16 on a MoE model sized for one GPU.

The model is Qwen3-MoE shaped (default: 8 layers, hidden 2048, 16 heads of 128 with 4 KV
heads, 16 experts of width 2048, top-2, vocab 32768; about 1.8B parameters, 0.35B active per
token), built by our builder (Transformer Engine layer spec, grouped-GEMM experts) and trained
by our Policy (Megatron optimizer, packed micro-batches). Each variant runs in a fresh process:
bf16, then every FP8 recipe (delayed, current, blockwise, mxfp8); a recipe this GPU or TE
version cannot run is reported as skipped with the validation message. All variants start from
the same weights (same seed; the checksum of the initial weights is compared) and train
--steps steps on the same synthetic batches: sequences from a fixed random bigram model (each
token has 8 likely successors), so the loss has somewhere to go (from ln V towards ~ln 8).

Measured, per variant:
  tokens/s    trained tokens per second over the steps after --warmup (CUDA-synchronized)
  MFU         model FLOPs per second / the GPU's dense BF16 peak (989 TFLOP/s on H100 SXM and
              H200; --peak-tflops for others). FP8 rows use the same BF16 peak, so they show
              the speed-up directly (FP8's own dense peak is twice that).
              FLOPs per step = 6 * N_active * T + 6 * L * n_heads * head_dim * sum(s_i^2), with
              T trained tokens, N_active the matmul parameters one token passes (attention,
              router, top-k experts' MLPs, LM head; not the embedding lookup), and the second
              term causal attention (QK^T and AV, forward + backward) over packed samples of
              lengths s_i.
  loss diff   |L_fp8 - L_bf16| / L_bf16 per step: mean over all steps, and over the last 10
  memory      peak allocated GPU memory

Results (GPU, CUDA, torch, Transformer Engine and Megatron-Core versions, date, command) are
written as markdown to benchmarks/results/fp8_moe_<gpu>.md.

    python benchmarks/fp8_moe.py                   # the full matrix (not yet timed on a GPU)
    python benchmarks/fp8_moe.py --quick           # a tiny model, 6 steps: checks the pipeline
    python benchmarks/fp8_moe.py --recipes bf16 blockwise --steps 100
    python benchmarks/fp8_moe.py ... --json OUT.json --split-time   # figures for gpu_verify.py; the MoE
                                                 # layers' and the output head's time apart (CUDA events)

Needs a CUDA GPU with Transformer Engine; elsewhere it exits with status 2 and says so.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import importlib.util
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

VARIANTS = ("bf16", "delayed", "current", "blockwise", "mxfp8")
NOT_MEASURED = 2  # exit status without CUDA + Transformer Engine
# Dense BF16 tensor-core peaks (TFLOP/s), matched against torch.cuda.get_device_name in order.
PEAK_BF16_TFLOPS = [
    (r"H100.*PCIe", 756.0),
    (r"H100.*NVL", 835.0),
    (r"H100|H200|H800", 989.0),
]


def model_config(args) -> dict:
    """The HF config.json of the benchmark model (Qwen3-MoE, so the bridge and presets apply)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": args.vocab, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
        "intermediate_size": args.expert_width, "moe_intermediate_size": args.expert_width,
        "num_experts": args.experts, "num_experts_per_tok": args.top_k, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "tie_word_embeddings": False, "hidden_act": "silu", "initializer_range": 0.02,
    }


def active_params_per_token(hf: dict) -> int:
    """Matmul parameters one token passes through (see the module docstring)."""
    hidden, head_dim = hf["hidden_size"], hf["head_dim"]
    attention = hidden * (hf["num_attention_heads"] + 2 * hf["num_key_value_heads"]) * head_dim \
        + hf["num_attention_heads"] * head_dim * hidden
    router = hidden * hf["num_experts"]
    experts = hf["num_experts_per_tok"] * 3 * hidden * hf["moe_intermediate_size"]
    return hf["num_hidden_layers"] * (attention + router + experts) + hf["vocab_size"] * hidden


def step_flops(hf: dict, sample_lengths: list[int]) -> float:
    tokens = sum(sample_lengths)
    attention = 6 * hf["num_hidden_layers"] * hf["num_attention_heads"] * hf["head_dim"] * sum(s * s for s in sample_lengths)
    return 6 * active_params_per_token(hf) * tokens + attention


def head_flops(hf: dict, tokens: int) -> float:
    """The output head's share of step_flops: its GEMM forward and backward."""
    return 6 * hf["vocab_size"] * hf["hidden_size"] * tokens


class SplitTimer:
    """CUDA-event time of the decoder layers (the MoE layers) and of the output head, forward and
    backward, summed over a step's micro-batches (--split-time).

    Module hooks mark the forward (decoder in, decoder out, head out); gradient hooks on the same
    tensors mark the backward: the head's starts when the logits' gradient is ready and ends when
    the decoder output's is, the decoder's ends when its input's (the embedding's output) is. What
    is in neither part: the embedding, the loss and logprobs, the optimizer step."""

    def __init__(self, model):
        self.marks: list[tuple[str, torch.cuda.Event]] = []
        model.decoder.register_forward_pre_hook(self._decoder_in, with_kwargs=True)
        model.decoder.register_forward_hook(self._decoder_out)
        model.output_layer.register_forward_hook(self._head_out)

    def _mark(self, label: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.marks.append((label, event))

    def _on_grad(self, tensor, label: str) -> None:
        if torch.is_grad_enabled() and tensor is not None and tensor.requires_grad:
            tensor.register_hook(lambda grad: self._mark(label))

    def _decoder_in(self, module, args, kwargs):
        self._mark("decoder forward start")
        self._on_grad(kwargs.get("hidden_states", args[0] if args else None), "decoder backward end")

    def _decoder_out(self, module, args, output):
        self._mark("decoder forward end")
        self._on_grad(output[0] if isinstance(output, tuple) else output, "decoder backward start")

    def _head_out(self, module, args, output):
        self._mark("head forward end")
        self._on_grad(output[0] if isinstance(output, tuple) else output, "head backward start")

    # Each end mark closes the interval opened by the latest mark of its pair.
    PAIRS = {"decoder forward end": ("decoder forward start", "decoder"),
             "head forward end": ("decoder forward end", "head"),
             "decoder backward start": ("head backward start", "head"),
             "decoder backward end": ("decoder backward start", "decoder")}

    def take(self) -> dict[str, float]:
        """Seconds per part since the last take (synchronizes)."""
        torch.cuda.synchronize()
        seconds, latest = {"decoder": 0.0, "head": 0.0}, {}
        for label, event in self.marks:
            if label in self.PAIRS and self.PAIRS[label][0] in latest:
                start, part = self.PAIRS[label]
                seconds[part] += latest[start].elapsed_time(event) / 1e3
            latest[label] = event
        self.marks.clear()
        return seconds


def synthetic_steps(vocab: int, steps: int, tokens_per_step: int, min_len: int, max_len: int, seed: int = 0):
    """Per step, a list of token sequences from a fixed random bigram model (identical for every variant)."""
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 8), generator=generator).tolist()
    batches = []
    for _ in range(steps):
        samples, total = [], 0
        while total < tokens_per_step:
            length = max(2, min(int(torch.randint(min_len, max_len + 1, (1,), generator=generator)), tokens_per_step - total))
            choices = torch.randint(0, 8, (length,), generator=generator).tolist()
            tokens = [choices[0] * (vocab // 8)]
            for choice in choices[1:]:
                tokens.append(successors[tokens[-1]][choice])
            samples.append(tokens)
            total += length
        batches.append(samples)
    return batches


def missing_requirements() -> list[str]:
    missing = []
    if not torch.cuda.is_available():
        missing.append("no CUDA device")
    if importlib.util.find_spec("transformer_engine") is None:
        missing.append("transformer-engine is not installed")
    return missing


def versions() -> dict:
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return {"torch": torch.__version__, "cuda": torch.version.cuda, "megatron-core": version("megatron-core"),
            "transformer-engine": version("transformer-engine")}


# ------------------------------------------------------------------------------------------------
# One variant, in its own process.
# ------------------------------------------------------------------------------------------------


def run_variant(args) -> dict:
    from megatron_rl.algorithms import compute_step_normalizer
    from megatron_rl.config import load_config
    from megatron_rl.errors import ConfigError
    from megatron_rl.model.packing import pack_by_token_budget
    from megatron_rl.model.policy import Policy
    from megatron_rl.runtime import start_runtime

    hf = model_config(args)
    config_dir = Path(tempfile.mkdtemp(prefix="fp8-moe-bench-"))
    (config_dir / "config.json").write_text(json.dumps(hf))
    overrides = ["device=cuda", f"model.hf_config={config_dir}", "model.precision=bf16",
                 f"micro_batch_tokens={args.micro_batch_tokens}", f"optimizer.lr={args.lr}", "optimizer.clip_grad=1.0",
                 "optimizer.adam_beta2=0.95"]
    if args.child != "bf16":
        overrides.append(f"model.fp8_recipe={args.child}")
    overrides += args.set  # after ours: a --set of the same key wins
    config = load_config(None, overrides)
    runtime = start_runtime(config)
    try:
        policy = Policy(config, runtime)
    except ConfigError as exc:  # this GPU / TE version cannot run the recipe: say why
        runtime.shutdown()
        return {"variant": args.child, "skipped": str(exc)}
    with torch.no_grad():
        checksum = sum(float(p.detach().double().square().sum()) for p in policy.module.parameters())

    steps = synthetic_steps(hf["vocab_size"], args.steps, args.tokens_per_step, args.min_len, args.max_len)
    losses, seconds, flops, tokens, parts = [], [], [], [], []
    timer = SplitTimer(policy.module) if args.split_time else None
    for samples in steps:
        batches = pack_by_token_budget(samples, [1] * len(samples), config.micro_batch_tokens, policy.pad_to_multiple)
        normalizer = compute_step_normalizer([b.loss_mask for b in batches], group=policy.dp_group,
                                             device=runtime.device).num_tokens

        def loss_fn(logprobs, entropy, batch):
            return -(logprobs * batch.loss_mask[0]).sum() / normalizer, {}

        profiled = args.profile and len(seconds) == len(steps) - 1  # the last step, after the timed ones settle
        with profile_step(profiled) as profiler:
            torch.cuda.synchronize()
            tick = time.perf_counter()
            result = policy.train_step(batches, loss_fn)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - tick)
        if profiled:
            write_profile(profiler, f"{args.profile}_{args.child}.txt")
        if timer:
            parts.append(timer.take())
        losses.append(result.loss)
        flops.append(step_flops(hf, [len(s) for s in samples]))
        tokens.append(sum(len(s) for s in samples))
        if not math.isfinite(result.loss):
            break
    measured = slice(args.warmup, None)
    report = {
        "variant": args.child, "losses": losses, "init_checksum": checksum,
        "tokens_per_s": sum(tokens[measured]) / sum(seconds[measured]),
        "flops_per_s": sum(flops[measured]) / sum(seconds[measured]),
        "step_s": sum(seconds[measured]) / len(seconds[measured]),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "layers": "Transformer Engine" if policy.use_te else "local",
        "grouped_gemm": bool(policy.tconfig.moe_grouped_gemm),
    }
    if timer:
        head = sum(head_flops(hf, n) for n in tokens[measured])
        report["split"] = {"decoder_s": sum(p["decoder"] for p in parts[measured]) / len(parts[measured]),
                           "head_s": sum(p["head"] for p in parts[measured]) / len(parts[measured]),
                           "decoder_flops_per_s": (sum(flops[measured]) - head) / sum(p["decoder"] for p in parts[measured]),
                           "head_flops_per_s": head / sum(p["head"] for p in parts[measured])}
    runtime.shutdown()
    return report


def profile_step(enabled: bool):
    """torch.profiler around one step (CPU ops and CUDA kernels), or nothing."""
    if not enabled:
        return contextlib.nullcontext()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    return torch.profiler.profile(activities=activities)


def write_profile(profiler, path: str) -> None:
    """Where one step's time went: the ops and kernels by GPU time, then by CPU time of their own
    (a step whose GPU idles shows it here: launch overhead and host syncs are CPU time)."""
    events = profiler.key_averages()
    Path(path).write_text(
        "By GPU time (self):\n" + events.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90)
        + "\n\nBy CPU time (self):\n" + events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=90))


# ------------------------------------------------------------------------------------------------
# The parent: one process per variant, then the comparison.
# ------------------------------------------------------------------------------------------------


def peak_tflops(gpu: str, override: float | None) -> float | None:
    if override:
        return override
    return next((peak for pattern, peak in PEAK_BF16_TFLOPS if re.search(pattern, gpu)), None)


def relative_loss_diff(losses: list[float], reference: list[float], last: int | None = None) -> float:
    pairs = list(zip(losses, reference))[-last if last else 0:]
    return sum(abs(a - b) / abs(b) for a, b in pairs) / len(pairs)


def markdown(args, reports: list[dict], gpu: str, peak: float | None, hf: dict) -> str:
    bf16 = next((r for r in reports if r["variant"] == "bf16" and "losses" in r), None)
    lines = [
        f"# fp8_moe.py on {gpu}", "",
        f"Date: {datetime.date.today().isoformat()}. Versions: "
        + ", ".join(f"{k} {v}" for k, v in versions().items()) + ".",
        f"Command: `python benchmarks/fp8_moe.py {' '.join(sys.argv[1:])}`", "",
        f"Model: Qwen3-MoE shaped, {hf['num_hidden_layers']} layers, hidden {hf['hidden_size']}, "
        f"{hf['num_attention_heads']} heads x {hf['head_dim']} ({hf['num_key_value_heads']} KV), {hf['num_experts']} "
        f"experts of width {hf['moe_intermediate_size']}, top-{hf['num_experts_per_tok']}, vocab {hf['vocab_size']}; "
        f"{active_params_per_token(hf) / 1e6:.0f}M active matmul parameters per token. "
        f"{args.steps} steps of {args.tokens_per_step} tokens (samples {args.min_len}-{args.max_len} tokens, "
        f"micro-batches of {args.micro_batch_tokens}), timed after {args.warmup} warm-up steps.",
        f"MFU against the dense BF16 peak of {peak:g} TFLOP/s for every row." if peak else
        "MFU: n/a (unknown GPU; pass --peak-tflops).", "",
        "| variant | layers | tokens/s | MFU | step s | peak GiB | rel. loss diff vs BF16 (all / last 10) | final loss | init weights |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in reports:
        if "skipped" in r or "error" in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else f"failed: {r['error']}"
            lines.append(f"| {r['variant']} | {why} | | | | | | | |")
            continue
        mfu = f"{r['flops_per_s'] / (peak * 1e12):.1%}" if peak else "n/a"
        if bf16 and r is not bf16:
            whole, last = (relative_loss_diff(r["losses"], bf16["losses"], n) for n in (None, 10))
            diff = f"{whole:.2%} / {last:.2%}"
            same_start = math.isclose(r["init_checksum"], bf16["init_checksum"], rel_tol=1e-9)
            same = "same as BF16" if same_start else "DIFFERENT"
        else:
            diff, same = "-", "-"
        layers = r["layers"] + (", grouped GEMM" if r["grouped_gemm"] else "")
        lines.append(f"| {r['variant']} | {layers} | {r['tokens_per_s']:,.0f} | {mfu} | {r['step_s']:.3f} | "
                     f"{r['peak_memory_gib']:.1f} | {diff} | {r['losses'][-1]:.4f} | {same} |")
    split = [r for r in reports if "split" in r]
    if split:
        lines += ["", "Per step (--split-time, CUDA events): the decoder's MoE layers (attention and MoE, forward and "
                  "backward) apart from the output head (its GEMM forward and backward); the rest is the embedding, "
                  "the loss and the optimizer step.", "",
                  "| variant | MoE layers s | MoE layers MFU | head s | head MFU | rest s |", "| --- | --- | --- | --- | --- | --- |"]
        for r in split:
            p = r["split"]
            mfu = [f"{p[f'{part}_flops_per_s'] / (peak * 1e12):.1%}" if peak else "n/a" for part in ("decoder", "head")]
            lines.append(f"| {r['variant']} | {p['decoder_s']:.3f} | {mfu[0]} | {p['head_s']:.3f} | {mfu[1]} | "
                         f"{r['step_s'] - p['decoder_s'] - p['head_s']:.3f} |")
    if bf16:
        lines += ["", "Loss every 10 steps:", "",
                  "| step | " + " | ".join(r["variant"] for r in reports if "losses" in r) + " |",
                  "| --- |" + " --- |" * sum("losses" in r for r in reports)]
        for step in sorted({*range(0, len(bf16["losses"]), 10), len(bf16["losses"]) - 1}):
            cells = [f"{r['losses'][step]:.4f}" if step < len(r["losses"]) else "" for r in reports if "losses" in r]
            lines.append(f"| {step + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def json_report(reports: list[dict], peak: float | None, gpu: str, hf: dict) -> dict:
    """The variants' figures with MFU (and each part's MFU with --split-time) against `peak`."""
    for r in reports:
        if peak and "flops_per_s" in r:
            r["mfu"] = r["flops_per_s"] / (peak * 1e12)
            for part in ("decoder", "head"):
                if "split" in r:
                    r["split"][f"{part}_mfu"] = r["split"][f"{part}_flops_per_s"] / (peak * 1e12)
    return {"gpu": gpu, "peak_tflops": peak, "versions": versions(), "model": hf, "reports": reports}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-width", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--tokens-per-step", type=int, default=32768)
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--min-len", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--recipes", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--peak-tflops", type=float, help="dense BF16 peak of this GPU, if not in the table")
    parser.add_argument("--out", help="markdown results file (default: benchmarks/results/fp8_moe_<gpu>.md)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every variant (e.g. model.moe_permute_fusion=true)")
    parser.add_argument("--quick", action="store_true", help="a tiny model and 6 steps: checks the pipeline")
    parser.add_argument("--json", help="also write every variant's figures here (benchmarks/gpu_verify.py reads it)")
    parser.add_argument("--split-time", action="store_true",
                        help="time the decoder (MoE) layers and the output head apart (CUDA events)")
    parser.add_argument("--profile", metavar="PREFIX",
                        help="profile each variant's last step (torch.profiler) into PREFIX_<variant>.txt")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--report", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.layers, args.hidden, args.heads, args.kv_heads, args.head_dim = 2, 256, 4, 2, 64
        args.experts, args.expert_width, args.vocab, args.steps, args.warmup = 4, 256, 4096, 6, 2
        args.tokens_per_step, args.micro_batch_tokens, args.min_len, args.max_len = 4096, 2048, 64, 512

    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be smaller than --steps")
    if not 2 <= args.min_len <= args.max_len <= args.micro_batch_tokens:
        parser.error("need 2 <= --min-len <= --max-len <= --micro-batch-tokens (a sample fits one micro-batch)")

    missing = missing_requirements()
    if missing:
        print(f"fp8_moe.py measures FP8 training through Transformer Engine and needs a CUDA GPU with the "
              f"transformer-engine package ({'; '.join(missing)}). Nothing was measured. "
              "See benchmarks/README.md for running it on a GPU machine.", file=sys.stderr)
        sys.exit(NOT_MEASURED)

    if args.child:
        try:
            report = run_variant(args)
        except Exception as exc:  # reported in the table; the traceback stays on stderr
            import traceback

            traceback.print_exc()
            report = {"variant": args.child, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        Path(args.report).write_text(json.dumps(report))
        return

    gpu = torch.cuda.get_device_name(0)
    peak = peak_tflops(gpu, args.peak_tflops)
    reports = []
    with tempfile.TemporaryDirectory() as scratch:
        for variant in args.recipes:
            report_file = Path(scratch) / f"{variant}.json"
            command = [sys.executable, __file__, *sys.argv[1:], "--child", variant, "--report", str(report_file)]
            started = time.perf_counter()
            subprocess.run(command, check=False)
            report = json.loads(report_file.read_text()) if report_file.exists() else \
                {"variant": variant, "error": "the process died (see its output above)"}
            reports.append(report)
            status = report.get("skipped") or report.get("error") or \
                f"{report['tokens_per_s']:,.0f} tokens/s, final loss {report['losses'][-1]:.4f}"
            print(f"{variant}: {status} ({time.perf_counter() - started:.0f}s)", flush=True)
    text = markdown(args, reports, gpu, peak, model_config(args))
    if args.json:
        Path(args.json).write_text(json.dumps(json_report(reports, peak, gpu, model_config(args)), indent=1))
    slug = re.sub(r"[^a-z0-9]+", "_", gpu.lower().replace("nvidia", "")).strip("_")
    name = f"fp8_moe_{slug}{'_quick' if args.quick else ''}.md"
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / name
    out.write_text(text)
    print(text)
    print(f"written to {out}")


if __name__ == "__main__":
    main()
