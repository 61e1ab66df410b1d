#!/usr/bin/env python
"""Print what a megatron-rl checkpoint holds and whether its files verify.

    python tools/inspect_checkpoint.py PATH [--no-checksums] [--files]

PATH: a training checkpoint (a step_* directory), a run's checkpoints directory or a run
directory (meaning its latest checkpoint), or a converted model (`convert hf-to-megatron`,
`megatron-rl sft`). Prints the step, the layout it was written at, a summary of its config, the
files (with --files, each with its size) and the verdict of the manifest check (sizes and
CRC-32 checksums; conversions write a manifest too). Exit status: 0 if it verifies, 1 if not, 2
if PATH is not a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys

SUMMARY_KEYS = ("model.hf_config", "model.precision", "rl.recipe", "rl.steps", "rl.prompts_per_step",
                "rl.group_size", "optimizer.lr", "data.train", "data.prompt_format", "checkpoint.init_from")


def human(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path")
    parser.add_argument("--no-checksums", action="store_true", help="check sizes only (fast)")
    parser.add_argument("--files", action="store_true", help="list every file with its size")
    args = parser.parse_args(argv)

    from megatron_rl.checkpoint.store import MANIFEST, STATE, verify, verify_files
    from megatron_rl.checkpoint.config_change import flatten_config
    from megatron_rl.errors import ConfigError
    from megatron_rl.checkpoint.format import resolve_checkpoint

    try:
        path = resolve_checkpoint(args.path)
    except ConfigError as exc:
        print(f"inspect_checkpoint: {exc}", file=sys.stderr)
        return 2
    metadata_file = path / "megatron_rl.json"
    metadata = json.loads(metadata_file.read_text()) if metadata_file.is_file() else {}
    state = json.loads((path / STATE).read_text()) if (path / STATE).is_file() else {}
    print(f"checkpoint: {path}")
    if "step" in state or "step" in metadata:
        print(f"step: {state.get('step', metadata.get('step'))}")
    layout = metadata.get("saved_layout")
    if layout:
        print("written at: " + ", ".join(f"{k}={v}" for k, v in layout.items())
              + (f", {state['world_size']} ranks" if "world_size" in state else ""))
    if metadata:
        print(f"precision: {metadata.get('precision')}; padded vocabulary: {metadata.get('padded_vocab_size')} rows; "
              f"from: {metadata.get('source')}")
    hf_config = path / "hf_config" / "config.json"
    if hf_config.is_file():
        raw = json.loads(hf_config.read_text())
        print(f"model: {(raw.get('architectures') or ['?'])[0]}, {raw.get('num_hidden_layers')} layers, "
              f"hidden {raw.get('hidden_size')}, vocabulary {raw.get('vocab_size')}"
              + (f", {raw.get('num_experts') or raw.get('num_local_experts')} experts"
                 if raw.get("num_experts") or raw.get("num_local_experts") else ""))
    if state.get("policy"):
        scheduler = state["policy"].get("scheduler", {})
        print(f"optimizer: Adam step {state['policy'].get('adam_step')}, LR schedule at step "
              f"{scheduler.get('num_steps')}; per-parameter state: weights, optimizer moments"
              + (", " + ", ".join(state.get("keyed_like_weights", [])) if state.get("keyed_like_weights") else ""))
    if state.get("sampler"):
        print(f"data cursor: {json.dumps(state['sampler'])[:200]}")
    if state.get("config"):
        flat = flatten_config(state["config"])
        print("config: " + ", ".join(f"{key}={flat[key]}" for key in SUMMARY_KEYS if key in flat))

    files = sorted(p for p in path.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    print(f"files: {len(files)}, {human(total)}")
    if args.files:
        for file in files:
            print(f"  {human(file.stat().st_size):>10}  {file.relative_to(path)}")
    if not (path / MANIFEST).is_file() and not state:
        print("verify: no manifest (an sft output or an older conversion: complete when it was written)")
        return 0
    # A training checkpoint is verified whole (its trainer state too), a converted one file by file.
    problem = (verify if state else verify_files)(path, checksums=not args.no_checksums)
    what = "sizes" if args.no_checksums else "sizes and CRC-32 checksums"
    print(f"verify ({what}): " + ("ok" if problem is None else f"FAILED: {problem}"))
    return 0 if problem is None else 1


if __name__ == "__main__":
    sys.exit(main())
