"""benchmarks/fp8_moe.py's reports as a step-time table for `megatron-rl plan --measured` (the GPU
runs made before the MoE sweep, whose own report writes its table: moe_perf_report.py).

    python benchmarks/step_times_fp8_moe.py --out TABLE.jsonl REPORT.json [REPORT.json ...]

Each REPORT.json is read with its markdown twin REPORT.md (written by the same run): the date and
the command line, which name the micro-batch tokens and the --set levers the JSON does not hold.
A variant is a measurement of one GPU that holds every expert of its model (fp8_moe.py builds
one process with all the experts: EP1, TP1): the decoder's CUDA-event time per layer and token
(--split-time) and the head's. A report without that split is refused (its step time holds the
head and the optimizer step). Runs of the same key are one line, their median (measured.merge).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NOTE = "one GPU holding all the experts (EP1); the router's own routing at initialization (not forced to balance)"


def command_line(markdown: str, where: str) -> tuple[str, int, list[str]]:
    """(date, micro-batch tokens, --set overrides) from fp8_moe.py's markdown."""
    date = re.search(r"^Date: (\d{4}-\d\d-\d\d)\.", markdown, re.MULTILINE)
    command = re.search(r"^Command: `(.*)`$", markdown, re.MULTILINE)
    if not date or not command:
        raise SystemExit(f"{where}: no 'Date:' or 'Command:' line (is it fp8_moe.py's markdown?)")
    words = shlex.split(command.group(1))
    if "--micro-batch-tokens" not in words:
        raise SystemExit(f"{where}: the command names no --micro-batch-tokens")
    tokens = int(words[words.index("--micro-batch-tokens") + 1])
    sets = [words[i + 1] for i, word in enumerate(words) if word == "--set"]
    return date.group(1), tokens, sets


def entries(report_path: Path) -> list[dict]:
    from megatron_rl.config import load_config
    from megatron_rl.model.hf_config import parse_hf_config
    from megatron_rl.plan import measured

    report = json.loads(report_path.read_text())
    md = report_path.with_suffix(".md")
    date, micro_batch_tokens, sets = command_line(md.read_text(), str(md))
    model = report["model"]
    source = str(report_path.resolve().relative_to(REPO)) if report_path.resolve().is_relative_to(REPO) \
        else report_path.name
    layer = measured.layer_identity(parse_hf_config(model, str(report_path)))
    out = []
    for variant in report["reports"]:
        if "skipped" in variant:
            continue
        if "split" not in variant:
            raise SystemExit(f"{report_path}: variant {variant['variant']} has no --split-time figures: its step "
                             "time holds the head and the optimizer step, not a layer's time")
        tokens = variant["tokens_per_s"] * variant["step_s"]  # tokens per step
        recipe = [] if variant["variant"] == "bf16" else [f"model.fp8_recipe={variant['variant']}"]
        config = load_config(None, ["model.precision=bf16", f"micro_batch_tokens={micro_batch_tokens}", *recipe, *sets])
        run = {"layer_seconds_per_token": variant["split"]["decoder_s"] / model["num_hidden_layers"] / tokens,
               "head_seconds_per_token": variant["split"]["head_s"] / tokens, "source": source,
               "case": variant["variant"], "date": date, "tokens_per_s": variant["tokens_per_s"],
               "versions": report.get("versions") or {}}
        out.append(measured.entry(gpu=report["gpu"], layer=layer, local_experts=model["num_experts"],
                                  micro_batch_tokens=micro_batch_tokens, run=run, note=NOTE,
                                  settings=measured.step_settings(config, variant["layers"], variant["grouped_gemm"])))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the table to write (JSON lines)")
    parser.add_argument("reports", nargs="+", type=Path, help="fp8_moe.py --json files, each beside its .md")
    args = parser.parse_args()
    from megatron_rl.plan.measured import load_table, write_table

    write_table(Path(args.out), [line for path in args.reports for line in entries(path)])
    table = load_table(args.out)  # what the planner will read, checked the same way
    for m in table.measurements:
        print(f"line {m.line}: {m.gpu}, {m.layer_seconds_per_token * 1e6:.2f} us per layer and token "
              f"(median of {len(m.runs)} run(s): {', '.join(r['source'] + ' ' + r['case'] for r in m.runs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
