"""HF safetensors <-> Megatron `torch_dist` conversion (tools/convert_*.py and `megatron-rl convert`).

The checkpoint format and the forms a checkpoint can be named in: checkpoint/format.py.

Everything that can be checked without processes is checked first, the output location before
any input file is read: the output is none of the inputs, contains none and lies inside none
(--force or not), it does not exist (with --force: unless it is an earlier output of the same
conversion, told by its marker; checkpoint/output_guard.py), its parent is a writable
directory, and its filesystem has room for the output (estimated from the input's sizes). Then
the input: it exists, describes a supported architecture, agrees with its MANIFEST.json (when it
has one: the input's checksums); the layout fits the model. hf-to-megatron at a layout of more
than one rank re-launches itself under torchrun (each rank writes its own shards);
megatron-to-hf always runs in one process, whatever layout the checkpoint was saved at.
peft-to-megatron is hf-to-megatron with a PEFT LoRA adapter's adapters written beside the base
weights (tools/convert_lora.PeftInput, bridge/peft_import.py), the adapter checked whole first.

Neither builds the model's weights: the model is built on the meta device and each weight passes
through while it is written, one tensor (hf-to-megatron) or one bucket of --bucket-mb
(megatron-to-hf) at a time (bridge/streamed.py), so memory does not grow with the model.

Output appears atomically: a failure leaves no partial directory (nor the parent directories the
run created), and so does SIGINT/SIGTERM (forwarded to every rank; each stops, removes the staging
directory and exits nonzero). A disk that fills up during the write anyway is named as such, with
the free space, not as the writer's own error.

Every output carries a MANIFEST.json, the one training checkpoints carry (each file's size and
CRC-32; checkpoint/store.py), so a damaged file is named when the output is read: by the other
conversion, `checkpoint.init_from`, `verify-hf`. Both directions take each weight file's CRC-32
while writing it, so the manifest reads no file again.
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.checkpoint.atomic_dir import AtomicDirectory
from megatron_rl.checkpoint.format import (
    REDOWNLOAD_OR_CONVERT,
    USE_ANOTHER,
    _chain,
    check_intact,
    check_weight_files,
    read_metadata,
    resolve_checkpoint,
    save_megatron_checkpoint,
    unloadable,
    weights_path,
)
from megatron_rl.checkpoint.output_guard import refuse_existing, refuse_overlap
from megatron_rl.config import RunConfig
from megatron_rl.errors import ConfigError
from megatron_rl.model.hf_config import load_hf_config
from megatron_rl.tools.output_sizes import hf_to_megatron_bytes, megatron_to_hf_bytes
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
# What a write that ran out of room raises: the errno, where one survives; else the text that
# carries it (a writer process's error turned into a message, the Rust safetensors writer), or
# torch.save's zip writer after a short write ("unexpected pos 704 vs 598"), which keeps no errno
# at all: a short write to a regular file only happens when the disk or a limit is reached.
DISK_FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
             errno.EFBIG: "a file size limit is reached (ulimit -f, or the filesystem's largest file)"}
SHORT_WRITE = ("unexpected pos", "basic_ios::clear")


HF_TO_MEGATRON = "HF safetensors directory -> Megatron torch_dist checkpoint"
MEGATRON_TO_HF = "Megatron torch_dist checkpoint -> HF safetensors directory (one process, whatever layout the " \
                 "checkpoint was saved at)"


def hf_to_megatron_parser(prog: str = "megatron-rl convert hf-to-megatron") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=HF_TO_MEGATRON)
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default=None,
                        help="parameter dtype (default: the checkpoint's dtype when it is fp32 or bf16)")
    layout_args(parser)
    return parser


def megatron_to_hf_parser(prog: str = "megatron-rl convert megatron-to-hf") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=MEGATRON_TO_HF)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hf-template", default=None, help="copy tokenizer files from here (default: the checkpoint's)")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    parser.add_argument("--merge-lora", action="store_true",
                        help="a LoRA run's checkpoint: merge its adapters, W + (alpha / rank) B A (docs/lora.md)")
    parser.add_argument("--bucket-mb", type=int, default=512,
                        help="weights read at a time, in MiB (the conversion's memory is about this plus the "
                             "largest tensor, whatever the model's size)")
    # Layouts were once needed here; say so instead of argparse's "unrecognized arguments".
    for flag in ("--tp", "--pp", "--ep", "--etp", "--pp-first-stage-layers", "--pp-last-stage-layers"):
        parser.add_argument(flag, dest="layout_flag", action=_NameTheFlag, help=argparse.SUPPRESS)
    return parser


class _NameTheFlag(argparse.Action):
    """Records which of the refused flags was given (its value is not needed)."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.layout_flag = option_string


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
    check_input()
    _relaunch_if_needed(world_size_for(config), command, argv, env)


# ---- the output location, checked before any weight is read -----------------------------------


@dataclass
class Output:
    """Where a conversion writes. `existing`: the nearest directory at or above the output's
    parent that existed before this run (its filesystem is the one that must have room; a failed
    run removes the directories it created below it, and nothing at or above it)."""

    path: Path
    force: bool
    existing: Path
    owner: str  # the command, named by the output's marker: what --force may replace
    needed: int = 0  # bytes the output will take, about (estimated from the input)


def check_output_location(out: str, force: bool, owner: str, inputs: dict[str, str | Path | None],
                          inside_ok: tuple[str, ...] = ()) -> Output:
    """Refuse, before any input file is read: an output that is, contains or lies inside one of
    `inputs` ({flag: path}; `inside_ok`: those it may lie inside), whatever --force says; an
    existing output (with --force: unless `owner` wrote it); a parent that is not a directory this
    process can write into."""
    refuse_overlap(out, inputs, inside_ok=inside_ok)
    out = Path(out)
    refuse_existing(out, force, owner)
    existing = _nearest_existing(out.parent)
    if not existing.is_dir():
        raise ConfigError(f"cannot write {out}: {existing} is a file, not a directory; pass an --out inside a "
                          "directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "is on a read-only filesystem" if _read_only(existing) else "is not writable by this user"
        raise ConfigError(f"cannot write {out}: {existing} {why}; pass an --out in a directory you can write to")
    return Output(out, force, existing, owner)


def _nearest_existing(path: Path) -> Path:
    return next(p for p in (path, *path.parents) if p.exists() or p.is_symlink())


def _read_only(path: Path) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def check_free_space(output: Output, needed: int) -> None:
    """Refuse when the output's filesystem has less free space than the output will take. With
    --force the old output stays until the new one is complete, so both must fit: the free space
    measured now already counts the old one."""
    output.needed = needed
    free = shutil.disk_usage(output.existing).free
    if free < needed:
        raise ConfigError(f"not enough free space for {output.path}: the output needs about {_bytes(needed)}, "
                          f"the filesystem of {output.existing} has {_bytes(free)} free; free up space there, or "
                          "pass an --out on a disk with room")


def _bytes(count: int) -> str:
    size, unit = float(count), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{count} bytes" if unit == "B" else f"{count} bytes ({size:.1f} {unit})"


# ---- writing ------------------------------------------------------------------------------------


@contextmanager
def written_atomically(output: Output):
    """Collective. AtomicDirectory for a conversion's output, sealed with a MANIFEST.json (on
    global rank 0, once every rank's files are written: the writers gather before returning).
    Yields (staging directory, checksums): files the block enters there with their size and
    CRC-32, taken while writing, are not read again for the manifest.
    A failed write removes what this run created: the staging directory (AtomicDirectory) and
    the parent directories it made; nothing that existed before. A disk filling up is named."""
    try:
        with AtomicDirectory(output.path, force=output.force, owner=output.owner) as staging, _disk_full_named(output):
            checksums: dict[str, dict] = {}
            yield staging, checksums
            everyone = _gathered(checksums)
            if _global_rank() == 0:
                from megatron_rl.checkpoint.store import write_manifest

                write_manifest(staging, known={name: entry for part in everyone for name, entry in part.items()})
    except BaseException:
        if _global_rank() == 0:
            _remove_created_parents(output)
        raise


def _gathered(value) -> list:
    """Collective: every rank's `value` (a list of one in a single process)."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _remove_created_parents(output: Output) -> None:
    """The empty directories between the output and `output.existing`: AtomicDirectory made them."""
    for parent in output.path.parents:
        if parent == output.existing or output.existing not in parent.parents:
            return
        try:
            parent.rmdir()
        except OSError:
            return  # not empty (someone else writes there) or already gone


@contextmanager
def _disk_full_named(output: Output):
    """Inside the AtomicDirectory, so the free space is measured before the partial output goes:
    an error of the writer that says the disk is full becomes one line naming the output, the
    free space and what to do. Anything else passes unchanged."""
    try:
        yield
    except BaseException as exc:  # Megatron-Core's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        free = shutil.disk_usage(output.existing).free
        reason = disk_full_reason(exc, space_left=free >= output.needed)
        if reason is None:
            raise
        raise ConfigError(
            f"disk full while writing {output.path}: {reason}; {_bytes(free)} were free on the filesystem of "
            f"{output.existing} when the write failed, and the output needs about {_bytes(output.needed)}. The "
            "partial output is removed (nothing that existed before is touched); free up space there, or pass "
            "an --out on a disk with room, and run the conversion again") from exc


def disk_full_reason(exc: BaseException, space_left: bool = False) -> str | None:
    """Why `exc` means the disk (or a quota, or a file size limit) is full, or None if it does not.
    `space_left`: the filesystem still has room for the whole output (a short write then means a
    quota or a limit, not the disk)."""
    chain = list(_chain(exc))
    for error in chain:
        if isinstance(error, OSError) and error.errno in DISK_FULL:
            return DISK_FULL[error.errno]
    text = "\n".join(str(error) for error in chain)
    for number, reason in DISK_FULL.items():
        if os.strerror(number) in text:
            return reason
    short = next((marker for marker in SHORT_WRITE if marker in text), None)
    if short is None:
        return None
    line = next(line for line in text.splitlines() if short in line).strip()
    cause = "a disk quota or a file size limit is reached" if space_left else "no space left on the device"
    return f"{cause} (a short write: {line[-120:]})"


# ---- the two conversions ------------------------------------------------------------------------


def hf_to_megatron(argv: list[str], prog: str = "megatron-rl convert hf-to-megatron", peft: bool = False) -> None:
    """`peft`: peft-to-megatron, with a PEFT adapter's LoRA adapters (tools/convert_lora.PeftInput)."""
    from megatron_rl.tools.convert_lora import PeftInput

    command = "peft-to-megatron" if peft else "hf-to-megatron"
    args = (PeftInput.parser if peft else hf_to_megatron_parser)(prog).parse_args(argv)
    output = check_output_location(args.out, args.force, f"megatron-rl convert {command}",
                                   {"--hf-dir": args.hf_dir, **({"--adapter": args.adapter} if peft else {})})
    raw, _ = load_hf_config(args.hf_dir, "--hf-dir")  # a clear error for a missing or unsupported config
    precision = args.precision or _precision_of(raw)
    adapter = PeftInput(args, raw) if peft else None  # the adapter, checked whole before anything heavy
    config = hf_model_config(args.hf_dir, args, precision, adapter.overrides() if adapter else ())
    check_free_space(output, hf_to_megatron_bytes(args.hf_dir, raw, precision))
    from megatron_rl.bridge.importer import check_files

    def check_input():
        _verify_once(Path(args.hf_dir), REDOWNLOAD_OR_CONVERT)  # a `convert megatron-to-hf` output
        check_files(args.hf_dir)

    _preflight(config, args, command, argv, check_input=check_input,
               env={VERIFIED_ENV: str(Path(args.hf_dir).resolve())})

    from megatron_rl.bridge.importer import HfWeights
    from megatron_rl.bridge.streamed import MetaValues

    # The model on the meta device: each weight is read from the safetensors files only while the
    # writer writes it (bridge/streamed.py), so memory does not grow with the model.
    with model_on_this_rank(config, meta=True) as (runtime, built):
        with HfWeights(built.module, built.arch, args.hf_dir) as source, \
                written_atomically(output) as (staging, checksums):
            values = MetaValues(built.module, source.read)
            save_megatron_checkpoint(built.module, built.raw_hf_config, staging, config, tokenizer_dir=args.hf_dir,
                                     source=str(Path(args.hf_dir).resolve()), checksums=checksums,
                                     values=adapter.values(built, values) if adapter else values,
                                     extra=adapter.record(precision) if adapter else None)
        if runtime.is_driver:
            print(f"wrote {args.out} ({built.arch.architecture}, tp={args.tp} pp={args.pp} ep={args.ep})")


def _verify_once(path: Path, hint: str = USE_ANOTHER) -> None:
    """check_intact (it reads every file), in the launching process only: the ranks it starts
    are told it was done (VERIFIED_ENV)."""
    if os.environ.get(VERIFIED_ENV) != str(path.resolve()):
        check_intact(path, hint)


def _resolved_for_conversion(given: str) -> Path:
    """resolve_checkpoint; says which checkpoint a run directory stands for."""
    ckpt = resolve_checkpoint(given)
    if ckpt != Path(given) and "RANK" not in os.environ:
        print(f"reading checkpoint {ckpt}")
    return ckpt


def megatron_to_hf(argv: list[str], prog: str = "megatron-rl convert megatron-to-hf") -> None:
    args = megatron_to_hf_parser(prog).parse_args(argv)
    if args.layout_flag:
        raise ConfigError(f"{args.layout_flag} is not needed: megatron-to-hf reads a checkpoint saved at any layout "
                          "in one process (torch_dist stores every tensor whole); drop the layout flags")
    if args.bucket_mb < 1:
        raise ConfigError(f"--bucket-mb must be at least 1 (MiB of weights read at a time), not {args.bucket_mb}")
    ckpt = _resolved_for_conversion(args.ckpt)
    # A run directory given as --ckpt stands for its newest checkpoint: the output may lie inside
    # the run (not inside that checkpoint), but neither be it nor contain it.
    output = check_output_location(args.out, args.force, "megatron-rl convert megatron-to-hf",
                                   {"--ckpt": args.ckpt, "checkpoint": ckpt, "--hf-template": args.hf_template},
                                   inside_ok=("--ckpt",) if ckpt.resolve() != Path(args.ckpt).resolve() else ())
    metadata = read_metadata(ckpt)
    hf_config = str(ckpt / "hf_config")
    template = args.hf_template or hf_config
    check_free_space(output, megatron_to_hf_bytes(ckpt, template))
    from megatron_rl.tools.convert_lora import base_weights_for_merge, one_process_config, read_checkpoint_adapters, \
        recorded_model, require_lora

    lora = require_lora(ckpt, recorded_model(ckpt).get("lora"), "merge") if args.merge_lora else None
    _verify_once(ckpt)  # the input's checksums: after the output checks, it reads every file
    config = one_process_config(ckpt, metadata, lora)  # with the run's adapters for --merge-lora
    check_weight_files(weights_path(ckpt))
    base = base_weights_for_merge(ckpt, metadata)  # a LoRA checkpoint's base: its own weights or the one it names

    from megatron_rl.bridge.hf_checkpoint import write_hf_config
    from megatron_rl.checkpoint.unpickling import read_torch_dist_index
    from megatron_rl.bridge.streamed import TorchDistUnreadable, write_hf_from_torch_dist

    # The whole model on the meta device names every torch_dist key; the weights pass through one
    # bucket at a time (bridge/streamed.py), so memory does not grow with the model.
    weights = weights_path(ckpt)
    with model_on_this_rank(config, meta=True) as (runtime, built):
        adapters = read_checkpoint_adapters(built.module, weights) if lora else None
        # A checkpoint that refers to its base holds the state training moved beside its adapters
        # (the routers' expert bias): read from it, the rest from the base, as a resume loads them.
        held = (weights, read_torch_dist_index(weights)) if base.resolve() != weights.resolve() else None
        with written_atomically(output) as (staging, checksums):
            try:
                checksums.update(write_hf_from_torch_dist(built.module, built.arch, base,
                                                          read_torch_dist_index(base), staging,
                                                          precision=metadata["precision"],
                                                          bucket_bytes=args.bucket_mb << 20, adapters=adapters,
                                                          held=held))
            except TorchDistUnreadable as exc:
                raise ConfigError(unloadable(base, exc.__cause__) if exc.__cause__ is not None
                                  else f"{base}: {exc}; {USE_ANOTHER}") from exc
            write_hf_config(built.raw_hf_config, built.arch, staging, template_dir=template)
        print(f"wrote {args.out} ({built.arch.architecture})")


def megatron_to_peft(argv: list[str], prog: str = "megatron-rl convert megatron-to-peft") -> None:
    from megatron_rl.tools.convert_lora import (
        BASE_DIR, megatron_to_peft_parser, peft_export_bytes, recorded_model, require_lora, trained_base,
        write_peft_export,
    )

    args = megatron_to_peft_parser(prog).parse_args(argv)
    ckpt = _resolved_for_conversion(args.ckpt)
    output = check_output_location(args.out, args.force, "megatron-rl convert megatron-to-peft",
                                   {"--ckpt": args.ckpt, "checkpoint": ckpt},
                                   inside_ok=("--ckpt",) if ckpt.resolve() != Path(args.ckpt).resolve() else ())
    metadata, model = read_metadata(ckpt), recorded_model(ckpt)
    require_lora(ckpt, model.get("lora"), "export")
    _verify_once(ckpt)
    base = trained_base(ckpt, metadata, model) if args.write_base else None  # the one the adapters were trained on
    if base is not None:
        check_free_space(output, peft_export_bytes(ckpt, base))
    count = write_peft_export(ckpt, metadata, model, lambda: written_atomically(output), Path(args.out), base)
    print(f"wrote {args.out} ({count} adapters as a PEFT directory"
          + (f", their base as a Hugging Face directory in {BASE_DIR}/)" if base is not None else ")"))


COMMANDS = {"hf-to-megatron": hf_to_megatron, "megatron-to-hf": megatron_to_hf, "megatron-to-peft": megatron_to_peft,
            "peft-to-megatron": lambda argv, prog: hf_to_megatron(argv, prog, peft=True)}
USAGE = f"usage: megatron-rl convert {{{','.join(COMMANDS)}}} ..."


def usage_text() -> str:
    """`megatron-rl convert --help`."""
    return (f"{USAGE}\n\nHF safetensors <-> Megatron torch_dist checkpoint conversion.\n\ncommands:\n"
            f"  hf-to-megatron  {HF_TO_MEGATRON}\n  megatron-to-hf  {MEGATRON_TO_HF}\n"
            "  megatron-to-peft  a LoRA run's adapters as a PEFT directory\n"
            "  peft-to-megatron  a PEFT adapter and its HF base as one Megatron checkpoint (base and adapters)\n\n"
            "megatron-rl convert COMMAND --help lists a command's options.\n")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """`prog`: the program name a command's usage shows (default `megatron-rl convert COMMAND`;
    the tools scripts pass their own)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(usage_text(), end="")
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(USAGE, file=sys.stderr)
        return 2
    # Quiet like the CLI (the tools scripts and the ranks torchrun starts come here directly);
    # MEGATRON_RL_VERBOSE=1 keeps the dependencies' warnings.
    if os.environ.get("MEGATRON_RL_VERBOSE") != "1":
        from megatron_rl.observability.console import quiet_dependencies

        quiet_dependencies()
    try:
        with signals_raise():
            COMMANDS[argv[0]](argv[1:], prog or f"megatron-rl convert {argv[0]}")
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
