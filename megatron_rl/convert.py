"""HF safetensors <-> Megatron `torch_dist` conversion (tools/convert_*.py and `megatron-rl convert`).

A converted Megatron checkpoint directory holds Megatron's torch_dist files plus:
    hf_config/           the model's config.json and tokenizer files (the model is self-described)
    megatron_rl.json     format tag, padded vocabulary size, the layout and precision it was saved at

`save_megatron_checkpoint` writes this format (here and in `megatron-rl sft`); megatron-to-hf
reads it, and `megatron-rl train checkpoint.init_from=DIR` starts from it.

Everything that can be checked without processes is checked first: the input exists and describes
a supported architecture, the output does not exist (unless --force), the layout fits the model.
A conversion that needs more than one rank re-launches itself under torchrun. Output appears
atomically: a failure leaves no partial directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from megatron_rl.atomic_dir import AtomicDirectory, refuse_existing
from megatron_rl.config import ConfigError, RunConfig, load_config
from megatron_rl.model.hf_config import load_hf_config, parse_hf_config

FORMAT = "megatron_rl.torch_dist.v1"
METADATA = "megatron_rl.json"


def _layout_args(parser: argparse.ArgumentParser) -> None:
    for name in ("tp", "pp", "ep"):
        parser.add_argument(f"--{name}", type=int, default=1)
    parser.add_argument("--etp", type=int, default=None, help="expert tensor parallel (default: same as --tp)")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")


def hf_to_megatron_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="HF safetensors directory -> Megatron torch_dist checkpoint")
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default=None,
                        help="parameter dtype (default: the checkpoint's dtype when it is fp32 or bf16)")
    _layout_args(parser)
    return parser


def megatron_to_hf_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Megatron torch_dist checkpoint -> HF safetensors directory")
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hf-template", default=None, help="copy tokenizer files from here (default: the checkpoint's)")
    _layout_args(parser)
    return parser


def _config(hf_config: str, args, precision: str, extra: list[str] = ()) -> RunConfig:
    overrides = [
        "device=cpu", f"model.hf_config={hf_config}", f"model.precision={precision}",
        f"parallel.tp={args.tp}", f"parallel.pp={args.pp}", f"parallel.ep={args.ep}",
        # The distributed optimizer is irrelevant here (no optimizer is built).
        *([f"parallel.etp={args.etp}"] if args.etp is not None else []), *extra,
    ]
    return load_config(None, overrides)


def world_size_for(config: RunConfig) -> int:
    """Smallest world that fits both the dense (tp*pp) and the expert (etp*ep*pp) layouts."""
    p = config.parallel
    return math.lcm(p.tp * p.pp * p.cp, p.expert_tp * p.ep * p.pp)


def _precision_of(raw: dict) -> str:
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return "bf16" if dtype == "bfloat16" else "fp32"


def _validate(config: RunConfig) -> None:
    from megatron_rl.model.layout_checks import check_divisibility  # layout vs model, no processes needed

    arch = parse_hf_config(*load_hf_config(config.model.hf_config))
    config.parallel.validate_for_model("layout", num_experts=arch.num_experts)
    check_divisibility(arch, config)


def _relaunch_if_needed(world: int, script: str, argv: list[str]) -> bool:
    """Run this conversion under torchrun when it needs several ranks and is not already under one."""
    if world == 1 or "RANK" in os.environ:
        return False
    from megatron_rl.platform.distributed import free_port

    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
               f"--master-port={free_port()}", "-m", "megatron_rl.convert", script, *argv]
    sys.exit(subprocess.call(command, env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))))


def _preflight(config: RunConfig, args, command: str, argv: list[str]) -> None:
    """Everything checkable without processes; then re-launch under torchrun if ranks are needed."""
    _validate(config)
    refuse_existing(args.out, args.force)
    _relaunch_if_needed(world_size_for(config), command, argv)


@contextmanager
def _model_on_this_rank(config: RunConfig):
    """(runtime, built model) for this rank; the runtime is shut down however the block ends."""
    from megatron_rl.model.builder import build_model
    from megatron_rl.platform import start_runtime

    runtime = start_runtime(config)
    try:
        yield runtime, build_model(config, runtime.device)
    finally:
        runtime.shutdown()


def hf_to_megatron(argv: list[str]) -> None:
    args = hf_to_megatron_parser().parse_args(argv)
    raw, _ = load_hf_config(args.hf_dir)  # a clear error for a missing or unsupported config
    config = _config(args.hf_dir, args, args.precision or _precision_of(raw))
    _preflight(config, args, "hf-to-megatron", argv)

    from megatron_rl.bridge import load_hf_weights

    with _model_on_this_rank(config) as (runtime, built):
        load_hf_weights(built.module, built.arch, args.hf_dir)
        with AtomicDirectory(args.out, force=args.force) as staging:
            save_megatron_checkpoint(built.module, built.raw_hf_config, staging, config,
                                     tokenizer_dir=args.hf_dir, source=str(Path(args.hf_dir).resolve()))
        if runtime.is_main:
            print(f"wrote {args.out} ({built.arch.architecture}, tp={args.tp} pp={args.pp} ep={args.ep})")


def save_megatron_checkpoint(module, raw_hf_config: dict, directory: Path, config: RunConfig, *,
                             tokenizer_dir: str | Path | None, source: str, extra: dict | None = None) -> None:
    """Collective: the model's weights as torch_dist files in `directory` (empty, e.g. an
    AtomicDirectory's staging), then, on global rank 0, hf_config/ (config.json and the tokenizer
    files found in `tokenizer_dir`) and megatron_rl.json. `extra`: more fields for megatron_rl.json."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_rl.bridge.hf_checkpoint import copy_tokenizer_files

    directory = Path(directory)
    dist_checkpointing.save(module.sharded_state_dict(), str(directory))
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    (directory / "hf_config").mkdir()
    (directory / "hf_config" / "config.json").write_text(json.dumps(raw_hf_config, indent=2) + "\n")
    copy_tokenizer_files(tokenizer_dir, directory / "hf_config")
    p = config.parallel
    metadata = {
        "format": FORMAT,
        "padded_vocab_size": module.vocab_size,
        "precision": config.model.precision,
        "saved_layout": {"tp": p.tp, "pp": p.pp, "ep": p.ep, "etp": p.expert_tp},
        "source": source,
        **(extra or {}),
    }
    (directory / METADATA).write_text(json.dumps(metadata, indent=2) + "\n")


def is_megatron_checkpoint(path: str | Path) -> bool:
    """A directory in the format above (else, for checkpoint.init_from: a Hugging Face model)."""
    return (Path(path) / METADATA).is_file()


def pin_checkpoint_vocab(config: RunConfig) -> RunConfig:
    """`config` with model.padded_vocab_size taken from checkpoint.init_from when that is a
    megatron-rl checkpoint and the size is not set: the padding depends on the TP size the
    checkpoint was saved at, and pinning it lets the checkpoint load at any other layout."""
    source = config.checkpoint.init_from
    if source is None or config.model.padded_vocab_size is not None or not is_megatron_checkpoint(source):
        return config
    rows = read_metadata(source)["padded_vocab_size"]
    return dataclasses.replace(config, model=dataclasses.replace(config.model, padded_vocab_size=rows))


def load_initial_weights(policy, source: str | Path) -> None:
    """checkpoint.init_from into a built Policy: a checkpoint in the format above (saved at any
    layout; build the policy from `pin_checkpoint_vocab(config)`) or a Hugging Face model directory."""
    if is_megatron_checkpoint(source):
        policy.load_model(str(source))  # refreshes the optimizer's main weights too
    else:
        from megatron_rl.bridge import load_hf_weights

        load_hf_weights(policy.module, policy.arch, source)
        policy.optimizer.reload_model_params()


def read_metadata(ckpt: str | Path) -> dict:
    path = Path(ckpt) / METADATA
    if not path.is_file():
        raise ConfigError(f"{ckpt} is not a checkpoint written by megatron-rl ({METADATA} is missing)")
    metadata = json.loads(path.read_text())
    if metadata.get("format") != FORMAT:
        raise ConfigError(f"{path}: format {metadata.get('format')!r} is not {FORMAT!r}")
    return metadata


def megatron_to_hf(argv: list[str]) -> None:
    args = megatron_to_hf_parser().parse_args(argv)
    metadata = read_metadata(args.ckpt)
    hf_config = str(Path(args.ckpt) / "hf_config")
    config = _config(hf_config, args, metadata["precision"], [f"model.padded_vocab_size={metadata['padded_vocab_size']}"])
    _preflight(config, args, "megatron-to-hf", argv)

    import torch
    from megatron.core import dist_checkpointing

    from megatron_rl.bridge.hf_checkpoint import write_hf_checkpoint

    with _model_on_this_rank(config) as (runtime, built):
        with torch.no_grad():
            state = dist_checkpointing.load(built.module.sharded_state_dict(), args.ckpt)
            built.module.load_state_dict(state)
        with AtomicDirectory(args.out, force=args.force) as staging:
            write_hf_checkpoint(built.module, built.arch, built.raw_hf_config, staging,
                                template_dir=args.hf_template or hf_config)
        if runtime.is_main:
            print(f"wrote {args.out} ({built.arch.architecture})")


COMMANDS = {"hf-to-megatron": hf_to_megatron, "megatron-to-hf": megatron_to_hf}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: megatron-rl convert {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        return 2
    try:
        COMMANDS[argv[0]](argv[1:])
    except ConfigError as exc:
        print(f"megatron-rl convert: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
