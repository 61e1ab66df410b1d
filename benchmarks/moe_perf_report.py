"""benchmarks/moe_perf.py's results: each case against its baseline, the goals, moe_perf.md, and
step_times.jsonl (the measured cases as `megatron-rl plan --measured`'s table).

Everything here reads the rows moe_perf.jsonl holds (one per case), so the markdown and the table
can be written again after every case and from a JSONL alone."""

from __future__ import annotations

import datetime
import json
import math
import sys
from pathlib import Path

# A lever must not change what is computed: its loss within BF16's relative precision (2^-8, one
# unit in the last place of a BF16 number) of the baseline's, as a mean over the same steps.
BF16_NOISE = 2.0 ** -8
DRY_RUN_GOALS = "not measured (CPU dry run: the goals are GPU figures)"
STEP_TIMES = "step_times.jsonl"


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def measured(row: dict) -> bool:
    return row.get("status") == "measured"


def against(row: dict, baseline: dict) -> dict:
    """The row's tokens/s as a ratio to its EP's baseline and its loss against the baseline's."""
    if not measured(baseline):
        return {"ratio_vs_baseline": None, "loss_vs_baseline": f"baseline {baseline['status']}"}
    pairs = list(zip(row["losses"], baseline["losses"]))
    diff = sum(abs(a - b) / abs(b) for a, b in pairs) / len(pairs) if pairs else math.nan
    return {"ratio_vs_baseline": row["tokens_per_s"] / baseline["tokens_per_s"], "loss_rel_diff_vs_baseline": diff,
            "loss_within_noise": bool(diff <= BF16_NOISE)}


def speed(row: dict) -> float:
    return row["mfu"] if row.get("mfu") is not None else row["tflops"]


def best(rows: list[dict]) -> dict | None:
    """The fastest measured case (model MFU; TFLOP/s without a peak) whose loss agrees with its baseline."""
    candidates = [r for r in rows if measured(r) and not r.get("profile") and r.get("loss_within_noise", True)]
    return max(candidates, key=speed, default=None)


def goals(rows: list[dict], dry_run: bool) -> list[dict]:
    """The four goals (emulated-EP8 BF16 model MFU >= 30%, blockwise FP8 >= 1.2x BF16 tokens/s, EP1 MoE
    layers' MFU >= 10%, GPU busy >= 80% of the step): the figure, the target and whether it was met,
    or not measured."""
    cases = [r for r in rows if r.get("phase") == "B" and measured(r) and not r.get("profile")]
    bf16 = {ep: [r for r in cases if r["ep"] == ep and not r.get("fp8")] for ep in (1, 8)}
    ep8 = best(bf16[8])
    fp8 = next((r for r in cases if r["ep"] == 8 and r.get("fp8")), None)
    fp8_base = next((r for r in cases if fp8 and r["case"] == fp8.get("base")), None)
    ep1 = max((r for r in bf16[1] if (r.get("split") or {}).get("decoder_mfu") is not None),
              key=lambda r: r["split"]["decoder_mfu"], default=None)
    profile = next((r for r in rows if r.get("profile") and measured(r)), None)
    busy = (profile or {}).get("profile", {}).get("busy_share")
    table = [
        ("emulated-EP8 BF16 model MFU (best case)", 0.30, ep8 and ep8.get("mfu"), ep8, "{:.1%}", ">= 30%"),
        ("blockwise FP8 / BF16 tokens/s at that shape", 1.2,
         fp8 and fp8_base and fp8["tokens_per_s"] / fp8_base["tokens_per_s"], fp8, "{:.2f}x", ">= 1.2x"),
        ("EP1 128-expert MoE layers MFU (best case)", 0.10, ep1 and ep1["split"]["decoder_mfu"], ep1, "{:.1%}", ">= 10%"),
        ("best case GPU busy share of the step", 0.80, busy, profile, "{:.0%}", ">= 80%"),
    ]
    out = []
    for goal, target, figure, row, fmt, text in table:
        shown = fmt.format(figure) if isinstance(figure, (int, float)) else "-"
        if dry_run:
            verdict = DRY_RUN_GOALS
        elif not isinstance(figure, (int, float)):
            verdict = "not measured" + (f" ({row['status']})" if row and not measured(row) else "")
        else:
            verdict = "met" if figure >= target else "not met"
        out.append({"goal": goal, "target": text, "figure": shown, "case": row["case"] if row else "-",
                    "verdict": verdict})
    return out


def percent(value) -> str:
    return f"{value:.1%}" if isinstance(value, (int, float)) else "n/a"


def one_line(row: dict) -> str:
    if row["phase"] == "A":
        return row["status"]
    return (f"{row['tokens_per_s']:,.0f} tokens/s, {row['tflops']:.3g} TFLOP/s, model MFU {percent(row.get('mfu'))}"
            f" ({percent(row.get('mfu_without_optimizer'))} without the optimizer step)")


def number(value, fmt: str) -> str:
    return fmt.format(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def phase_b_table(rows: list[dict]) -> list[str]:
    lines = ["| case | local experts | tokens / local expert / micro-batch | micro-batches / step | step s | "
             "optimizer s | tokens/s | TFLOP/s | model MFU | MFU without optimizer | MoE layers MFU | vs baseline | "
             "loss rel. diff vs baseline | within BF16 noise | routing max/mean | peak GiB | status |",
             "| --- " * 17 + "|"]
    for r in rows:
        layout, split = r.get("layout") or {}, r.get("split") or {}
        status = r["status"] + (f" (without: {', '.join(r['without'])})" if measured(r) and r.get("without") else "")
        lines.append("| " + " | ".join([
            r["case"], number(layout.get("local_experts"), "{}"), number(layout.get("tokens_per_local_expert"), "{:,.0f}"),
            number(r.get("micro_batches_per_step"), "{:.1f}"), number(r.get("step_s"), "{:.3f}"),
            number(r.get("optimizer_s"), "{:.3f}"), number(r.get("tokens_per_s"), "{:,.0f}"),
            number(r.get("tflops"), "{:.3g}"), number(r.get("mfu"), "{:.1%}"),
            number(r.get("mfu_without_optimizer"), "{:.1%}"), number(split.get("decoder_mfu"), "{:.1%}"),
            number(r.get("ratio_vs_baseline"), "{:.2f}x"), number(r.get("loss_rel_diff_vs_baseline"), "{:.2e}"),
            {True: "yes", False: "NO"}.get(r.get("loss_within_noise"), "-"), number(r.get("routing_imbalance"), "{:.3f}"),
            number(r.get("peak_memory_gib"), "{:.1f}"), status.replace("|", "/")]) + " |")
    return lines


def phase_a_table(rows: list[dict], dry_run: bool) -> list[str]:
    if dry_run:
        lines = ["| case | status | reference (CPU, tiny) | reference ms | reference TFLOP/s |", "| --- " * 5 + "|"]
        for r in rows:
            ms = number(r["reference_s"] * 1e3, "{:.3f}") if r.get("reference_s") is not None else "-"
            lines.append(f"| {r['case']} | {r['status']} | {r.get('reference', '-')} | {ms} | "
                         f"{number(r.get('reference_tflops'), '{:.3g}')} |")
        return lines
    lines = ["| case | GFLOP | host ms | GPU ms | GPU TFLOP/s | graph ms | graph TFLOP/s | status |", "| --- " * 8 + "|"]
    for r in rows:
        ms = {k: number(r[k] * 1e3, "{:.2f}") if isinstance(r.get(k), float) else "-" for k in ("host_s", "gpu_s", "graph_s")}
        status = r["status"] + (f"; graph: {r['graph_error']}" if r.get("graph_error") else "") + \
            (f": {r['error']}" if r.get("error") else "")
        lines.append(f"| {r['case']} | {number(r.get('flops', 0) / 1e9, '{:,.1f}')} | {ms['host_s']} | {ms['gpu_s']} | "
                     f"{number(r.get('gpu_tflops'), '{:.0f}')} | {ms['graph_s']} | {number(r.get('graph_tflops'), '{:.0f}')} | "
                     f"{status.replace('|', '/')} |")
    return lines


def markdown(rows: list[dict], args) -> str:
    b = [r for r in rows if r.get("phase") == "B"]
    a = [r for r in rows if r.get("phase") == "A"]
    where = "CPU dry run (a tiny model; not GPU figures)" if args.dry_run else \
        next((r["gpu"] for r in b if r.get("gpu")), "GPU")
    first = next((r for r in b if measured(r)), {})
    lines = [f"# MoE performance sweep: {where}", "",
             f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}, "
             f"`{' '.join(sys.argv).split('/benchmarks/')[-1]}`; versions: "
             + (", ".join(f"{k} {v}" for k, v in first.get("versions", {}).items()) or "-")
             + f"; MFU against {number(first.get('peak_tflops'), '{:g}')} TFLOP/s (dense BF16 peak).", "",
             "## Goals", "", "| goal | target | figure | case | verdict |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {g['goal']} | {g['target']} | {g['figure']} | {g['case']} | {g['verdict']} |" for g in goals(rows, args.dry_run)]
    head_share = (first.get("split") or {}).get("head_share_of_flops")
    lines += ["", "## Phase B: the slice as one GPU of an EP layout", "",
              "EP8 rows: one GPU's compute at EP 8, without the all-to-all: an upper bound. EP1 rows: every expert on "
              "the one GPU (the kit's stage-f layout). Routing forced to balance (megatron-core's "
              "moe_router_force_load_balancing); levers added one by one; each row's loss against its EP's baseline "
              f"over the same steps (BF16 noise: mean rel. diff <= 2^-8 = {BF16_NOISE:.2e})."
              + (f" The output head is {head_share:.0%} of the slice's FLOPs (about 10% in the 48-layer model), so the "
                 "model MFU leans on it; the MoE layers' MFU is apart." if head_share else ""), ""]
    lines += [f"- {r['layout']['derivation']} ({r['case']})" for r in b if measured(r) and r["levers"] == []]
    lines += [""] + phase_b_table(b)
    lines += ["", f"The measured cases (those within BF16 noise of their baseline, not the profile) are `{STEP_TIMES}` "
                  "beside this file: `megatron-rl plan --measured` ranks the layouts of their per-GPU shape by them "
                  "(docs/planning.md)."]
    profile = next((r for r in b if r.get("profile") and measured(r)), None)
    if profile:
        p = profile["profile"]
        lines += ["", f"Profile of the best case ({profile['case']}): GPU busy {number(p.get('busy_s'), '{:.3f}')} s "
                      f"of a {profile['step_s']:.3f} s step (share {number(p.get('busy_share'), '{:.0%}')}; of the "
                      f"profiled step itself, {p['step_s']:.3f} s: {number(p.get('busy_share_of_profiled_step'), '{:.0%}')}"
                      f"); ops and kernels: `{Path(p['table']).name}`."]
    lines += ["", "## Phase A: te.GroupedLinear alone (BF16 forward + backward)", "",
              "FLOPs 6 x rows x K x N; host: one iteration's enqueue; GPU: CUDA events (gaps included); graph: a "
              "CUDA-graph replay of the same (the kernels alone).", ""] + phase_a_table(a, args.dry_run)
    return "\n".join(lines) + "\n"


def step_time_entries(rows: list[dict], source: str) -> list[dict]:
    """The timed phase-B cases as lines of the planner's step-time table (megatron_rl/plan/measured.py):
    keyed by the slice's layer, its local experts, micro-batch tokens and settings (the config the
    case ran: the slice's own overrides, then its levers). Left out: cases not measured, the profiled
    rerun, and a lever whose loss left the baseline's (it changed what is computed). The layer figure
    is the decoder's CUDA-event time per layer and token; without that split (a CPU dry run) the
    step less the optimizer, per layer and token: the head and embedding inside it."""
    from megatron_rl.config import load_config
    from megatron_rl.model.hf_config import parse_hf_config
    from megatron_rl.plan import measured as table

    entries = []
    for r in rows:
        if r.get("phase") != "B" or not measured(r) or r.get("profile") or r.get("loss_within_noise") is False:
            continue
        model, layout, tokens = r["model"], r["layout"], r["tokens_per_step"]
        layers = model["num_hidden_layers"]
        if r.get("split"):
            layer, head = r["split"]["decoder_s"] / layers / tokens, r["split"]["head_s"] / tokens
        else:
            layer, head = (r["step_s"] - r["optimizer_s"]) / layers / tokens, None
        config = load_config(None, ["model.precision=bf16", f"micro_batch_tokens={r['micro_batch_tokens']}", *r["set"]])
        notes = [f"one GPU's compute at EP {r['ep']} (its {layout['local_experts']} experts), without the "
                 "all-to-all: a lower bound on its time"] if r["ep"] > 1 else []
        notes += ["routing forced to balance"] + ([] if head is not None else ["the head inside the layer figure"])
        run = {"layer_seconds_per_token": layer, "head_seconds_per_token": head, "source": source, "case": r["case"],
               "date": r.get("date") or "not recorded", "tokens_per_s": r["tokens_per_s"],
               "routing_imbalance": r.get("routing_imbalance"), "versions": r.get("versions") or {}}
        entries.append(table.entry(
            gpu=r.get("gpu") or table.CPU_DRY_RUN,
            layer=table.layer_identity(parse_hf_config(model, f"{source}: {r['case']}"), experts=layout["experts"]),
            local_experts=layout["local_experts"], micro_batch_tokens=r["micro_batch_tokens"],
            settings=table.step_settings(config, r["layers"], r["grouped_gemm"]), run=run, note="; ".join(notes)))
    return entries


def write(out: Path, args) -> None:
    from megatron_rl.plan.measured import write_table

    rows = read_rows(Path(out) / "moe_perf.jsonl")
    text = markdown(rows, args)
    try:
        write_table(Path(out) / STEP_TIMES, step_time_entries(rows, "moe_perf.jsonl"))
    except (KeyError, TypeError, ValueError) as exc:  # a row short of a field: the sweep's figures go on
        text += f"\n`{STEP_TIMES}` was NOT written: {type(exc).__name__}: {exc}\n"
    (Path(out) / "moe_perf.md").write_text(text)
