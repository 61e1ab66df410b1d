"""HF safetensors <-> Megatron `torch_dist` conversion (tools/convert_*.py and `megatron-rl convert`).

The checkpoint format and the forms a checkpoint can be named in: checkpoint/format.py.

Everything that can be checked without processes is checked first: the input exists and describes
a supported architecture, the output does not exist (unless --force), the layout fits the model.
A conversion that needs more than one rank re-launches itself under torchrun. Output appears
atomically: a failure leaves no partial directory, and so does SIGINT/SIGTERM (forwarded to
every rank; each stops, removes the staging directory and exits nonzero).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megatron_rl.checkpoint.atomic_dir import AtomicDirectory, refuse_existing
from megatron_rl.checkpoint.format import (
    check_intact,
    check_weight_files,
    load_megatron_weights,
    read_metadata,
    resolve_checkpoint,
    save_megatron_checkpoint,
    weights_path,
)
from megatron_rl.config import RunConfig
from megatron_rl.errors import ConfigError
from megatron_rl.model.hf_config import load_hf_config
from megatron_rl.tools.ranks import (
    Interrupted,
    hf_model_config,
    layout_args,
    model_on_this_rank,
    signals_raise,
    stop_helper_processes,
    torchrun,
    validate_layout,
    world_size_for,
)

# Set by the launching process for the ranks it starts: the checkpoint it already verified.
VERIFIED_ENV = "MEGATRON_RL_CONVERT_VERIFIED"


def hf_to_megatron_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="HF safetensors directory -> Megatron torch_dist checkpoint")
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default=None,
                        help="parameter dtype (default: the checkpoint's dtype when it is fp32 or bf16)")
    layout_args(parser)
    return parser


def megatron_to_hf_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Megatron torch_dist checkpoint -> HF safetensors directory")
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hf-template", default=None, help="copy tokenizer files from here (default: the checkpoint's)")
    layout_args(parser)
    return parser


def _precision_of(raw: dict) -> str:
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return "bf16" if dtype == "bfloat16" else "fp32"


def _relaunch_if_needed(world: int, script: str, argv: list[str], env: dict[str, str] | None = None) -> bool:
    """Run this conversion under torchrun when it needs several ranks and is not already under one.
    `env`: extra environment variables for the ranks."""
    if world == 1 or "RANK" in os.environ:
        return False
    sys.exit(torchrun(world, "megatron_rl.tools.convert", [script, *argv], env))


def _preflight(config: RunConfig, args, command: str, argv: list[str], *, check_input,
               env: dict[str, str] | None = None) -> None:
    """Everything checkable without processes (`check_input`: the input's files); then re-launch
    under torchrun if ranks are needed, with `env` added to their environment."""
    validate_layout(config)
    refuse_existing(args.out, args.force)
    check_input()
    _relaunch_if_needed(world_size_for(config), command, argv, env)


def hf_to_megatron(argv: list[str]) -> None:
    args = hf_to_megatron_parser().parse_args(argv)
    raw, _ = load_hf_config(args.hf_dir)  # a clear error for a missing or unsupported config
    config = hf_model_config(args.hf_dir, args, args.precision or _precision_of(raw))
    from megatron_rl.bridge.importer import check_files

    _preflight(config, args, "hf-to-megatron", argv, check_input=lambda: check_files(args.hf_dir))

    from megatron_rl.bridge import load_hf_weights

    with model_on_this_rank(config) as (runtime, built):
        load_hf_weights(built.module, built.arch, args.hf_dir)
        with AtomicDirectory(args.out, force=args.force) as staging:
            save_megatron_checkpoint(built.module, built.raw_hf_config, staging, config,
                                     tokenizer_dir=args.hf_dir, source=str(Path(args.hf_dir).resolve()))
        if runtime.is_driver:
            print(f"wrote {args.out} ({built.arch.architecture}, tp={args.tp} pp={args.pp} ep={args.ep})")


def _resolved_for_conversion(given: str) -> Path:
    """resolve_checkpoint, then (once: the launching process, not every rank) check_intact."""
    ckpt = resolve_checkpoint(given)
    if os.environ.get(VERIFIED_ENV) != str(ckpt.resolve()):
        check_intact(ckpt)
    if ckpt != Path(given) and "RANK" not in os.environ:
        print(f"reading checkpoint {ckpt}")
    return ckpt


def megatron_to_hf(argv: list[str]) -> None:
    args = megatron_to_hf_parser().parse_args(argv)
    ckpt = _resolved_for_conversion(args.ckpt)
    metadata = read_metadata(ckpt)
    hf_config = str(ckpt / "hf_config")
    config = hf_model_config(hf_config, args, metadata["precision"], [f"model.padded_vocab_size={metadata['padded_vocab_size']}"])
    _preflight(config, args, "megatron-to-hf", argv, check_input=lambda: check_weight_files(weights_path(ckpt)),
               env={VERIFIED_ENV: str(ckpt.resolve())})

    from megatron_rl.bridge.hf_checkpoint import write_hf_checkpoint

    with model_on_this_rank(config) as (runtime, built):
        load_megatron_weights(built.module, weights_path(ckpt))
        with AtomicDirectory(args.out, force=args.force) as staging:
            write_hf_checkpoint(built.module, built.arch, built.raw_hf_config, staging,
                                template_dir=args.hf_template or hf_config)
        if runtime.is_driver:
            print(f"wrote {args.out} ({built.arch.architecture})")


COMMANDS = {"hf-to-megatron": hf_to_megatron, "megatron-to-hf": megatron_to_hf}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: megatron-rl convert {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        return 2
    # Quiet like the CLI (the tools scripts and the ranks torchrun starts come here directly);
    # MEGATRON_RL_VERBOSE=1 keeps the dependencies' warnings.
    if os.environ.get("MEGATRON_RL_VERBOSE") != "1":
        from megatron_rl.observability.console import quiet_dependencies

        quiet_dependencies()
    try:
        with signals_raise():
            COMMANDS[argv[0]](argv[1:])
    except ConfigError as exc:
        print(f"megatron-rl convert: {exc}", file=sys.stderr)
        return 2
    except Interrupted as exc:
        stop_helper_processes()
        if not exc.reported and os.environ.get("RANK", "0") == "0":
            print(f"megatron-rl convert: stopped by {exc}; no output was published", file=sys.stderr)
        return 128 + exc.number
    return 0


if __name__ == "__main__":
    sys.exit(main())
