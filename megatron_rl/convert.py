"""HF safetensors <-> Megatron `torch_dist` conversion (tools/convert_*.py and `megatron-rl convert`).

A converted Megatron checkpoint directory holds Megatron's torch_dist files plus:
    hf_config/           the model's config.json and tokenizer files (the model is self-described)
    megatron_rl.json     format tag, padded vocabulary size, the layout and precision it was saved at

`save_megatron_checkpoint` writes this format (here and in `megatron-rl sft`); megatron-to-hf
reads it, and `megatron-rl train checkpoint.init_from=DIR` starts from it.

Everything that can be checked without processes is checked first: the input exists and describes
a supported architecture, the output does not exist (unless --force), the layout fits the model.
A conversion that needs more than one rank re-launches itself under torchrun. Output appears
atomically: a failure leaves no partial directory, and so does SIGINT/SIGTERM (forwarded to
every rank; each stops, removes the staging directory and exits nonzero).

megatron-to-hf (and `checkpoint.init_from`) read a checkpoint given in any of these forms
(`resolve_checkpoint`):
    DIR                   a directory holding megatron_rl.json (convert, sft output)
    RUN/checkpoints/step_000030   a training checkpoint: megatron_rl.json says where the weights are
                                  ("weights_dir"); its MANIFEST.json is verified before loading
    RUN/checkpoints       the step its `latest` file names
    RUN                   a run directory: RUN/checkpoints/latest
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from megatron_rl.atomic_dir import AtomicDirectory, refuse_existing, stop_signals_handled
from megatron_rl.config import ConfigError, RunConfig, load_config
from megatron_rl.model.hf_config import load_hf_config, parse_hf_config

FORMAT = "megatron_rl.torch_dist.v1"
METADATA = "megatron_rl.json"
MANIFEST = "MANIFEST.json"  # a training checkpoint's file list (megatron_rl.checkpoint)
LATEST = "latest"  # in a checkpoints directory: the name of the newest step directory
# Set by the launching process for the ranks it starts: the checkpoint it already verified.
VERIFIED_ENV = "MEGATRON_RL_CONVERT_VERIFIED"
USE_ANOTHER = "re-convert it, or use another checkpoint (e.g. an earlier step_* directory of the run)"


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM during a conversion. It unwinds like Ctrl-C, so the AtomicDirectory
    removes its staging directory; by default SIGTERM would end the process on the spot."""

    def __init__(self, number: int, reported: bool = False):
        super().__init__(signal.Signals(number).name)
        self.number = number
        self.reported = reported  # the ranks said so already


def _layout_args(parser: argparse.ArgumentParser) -> None:
    for name in ("tp", "pp", "ep"):
        parser.add_argument(f"--{name}", type=int, default=1)
    parser.add_argument("--etp", type=int, default=None, help="expert tensor parallel (default: same as --tp)")
    stage_args(parser)
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")


def stage_args(parser: argparse.ArgumentParser) -> None:
    """Uneven pipeline stages, for layer counts --pp does not divide (DeepSeek-V3's 61 layers)."""
    parser.add_argument("--pp-first-stage-layers", type=int, default=None,
                        help="layers on the first pipeline stage (the others split the rest evenly)")
    parser.add_argument("--pp-last-stage-layers", type=int, default=None, help="layers on the last pipeline stage")


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
        *([f"parallel.etp={args.etp}"] if args.etp is not None else []),
        *(f"parallel.{key}={getattr(args, key)}" for key in ("pp_first_stage_layers", "pp_last_stage_layers")
          if getattr(args, key, None) is not None),
        *extra,
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


def _relaunch_if_needed(world: int, script: str, argv: list[str], env: dict[str, str] | None = None) -> bool:
    """Run this conversion under torchrun when it needs several ranks and is not already under one.
    `env`: extra environment variables for the ranks."""
    if world == 1 or "RANK" in os.environ:
        return False
    sys.exit(_torchrun(world, "megatron_rl.convert", [script, *argv], env))


def _torchrun(world: int, module: str, argv: list[str], env: dict[str, str] | None = None) -> int:
    """`python -m module *argv` on `world` local ranks under torchrun (also `megatron-rl verify-hf`);
    its exit code. `env`: extra environment variables for the ranks. One thread per rank unless
    OMP_NUM_THREADS says otherwise: the ranks share this machine's cores."""
    from megatron_rl.platform.distributed import free_port

    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
               f"--master-port={free_port()}", "-m", module, *argv]
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    return _run_ranks(command, dict(os.environ, OMP_NUM_THREADS=threads, **(env or {})))


def _run_ranks(command: list[str], env: dict[str, str]) -> int:
    """Run torchrun and wait for it, forwarding SIGINT/SIGTERM to it.

    Killed alone, this process would orphan the ranks, which would then finish and publish the
    output. torchrun passes the signal to every rank (each removes its staging directory and
    exits) and kills the ranks that have not exited 30 s later. It runs in a session of its own, so
    a terminal's Ctrl-C reaches it only through us, once."""
    received: list[int] = []
    unsent: list[int] = []  # came while torchrun was starting
    child: subprocess.Popen | None = None

    def forward(number, frame):
        received.append(number)
        if child is None:
            unsent.append(number)
        else:
            child.send_signal(number)

    with stop_signals_handled(forward):
        child = subprocess.Popen(command, env=env, start_new_session=True)
        for number in unsent[:1]:
            child.send_signal(number)
        code = child.wait()
    if received:
        raise Interrupted(received[0], reported=code != 0)
    return code


@contextmanager
def _signals_raise():
    """SIGINT and SIGTERM raise Interrupted inside the block; a second one ends the process at once."""

    def stop(number, frame):
        for other in (signal.SIGINT, signal.SIGTERM):
            signal.signal(other, signal.SIG_DFL)
        raise Interrupted(number)

    with stop_signals_handled(stop):
        yield


def _stop_helper_processes() -> None:
    """End the multiprocessing children still running after an interrupt. Megatron-Core's
    checkpoint writer starts a Manager server (a non-daemon process) whose shutdown is registered
    only once it has started: interrupted before that, the interpreter would wait for it forever
    on exit."""
    import multiprocessing

    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout=5)
        if child.is_alive():
            child.kill()


def _preflight(config: RunConfig, args, command: str, argv: list[str], *, check_input,
               env: dict[str, str] | None = None) -> None:
    """Everything checkable without processes (`check_input`: the input's files); then re-launch
    under torchrun if ranks are needed, with `env` added to their environment."""
    _validate(config)
    refuse_existing(args.out, args.force)
    check_input()
    _relaunch_if_needed(world_size_for(config), command, argv, env)


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
    from megatron_rl.bridge.importer import check_files

    _preflight(config, args, "hf-to-megatron", argv, check_input=lambda: check_files(args.hf_dir))

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


def names_megatron_checkpoint(path: str | Path) -> bool:
    """`path` is meant as a megatron-rl checkpoint in one of the forms `resolve_checkpoint` takes
    (a checkpoint, a checkpoints directory, a run directory), not as a Hugging Face model."""
    path = Path(path)
    return is_megatron_checkpoint(path) or (path / LATEST).is_file() or (path / "checkpoints").is_dir()


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory (holding megatron_rl.json) that `path` names: itself, the step
    that `path/latest` names, or the one `path/checkpoints/latest` names (a run directory)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise ConfigError(f"checkpoint {path} is a file; pass the checkpoint directory (the one holding {METADATA})")
    if is_megatron_checkpoint(path):
        return path
    if (path / "checkpoints").is_dir():
        return _newest_step(path / "checkpoints", run=path)
    if (path / LATEST).is_file() or any(path.glob("step_*")):
        return _newest_step(path)
    raise ConfigError(
        f"{path} is not a megatron-rl checkpoint: it holds no {METADATA}, no {LATEST} file and no checkpoints/ "
        "directory. Pass the output of `megatron-rl convert hf-to-megatron` or `megatron-rl sft`, a training "
        "checkpoint (RUN/checkpoints/step_NNNNNN), RUN/checkpoints or the run directory RUN"
    )


def _newest_step(root: Path, run: Path | None = None) -> Path:
    """The step directory `root/latest` names; `run`: the run directory `root` belongs to."""
    latest = root / LATEST
    if not latest.is_file():
        steps = sorted(p.name for p in root.glob("step_*") if p.is_dir())
        if run is not None and not steps:
            raise ConfigError(f"run directory {run} has no checkpoints yet ({latest} does not exist)")
        hint = f"; pass a step directory instead, e.g. {root / steps[-1]}" if steps else ""
        raise ConfigError(f"{latest} does not exist, so the newest checkpoint is unknown{hint}")
    name = latest.read_text().strip()
    if not name or Path(name).name != name or name in (".", ".."):
        raise ConfigError(f"{latest} should hold the name of a step directory, not {name!r}; "
                          "pass a step directory (e.g. step_000030) instead")
    step = root / name
    if not step.is_dir():
        raise ConfigError(f"{latest} names {name}, but {step} does not exist (deleted?); pass an existing "
                          "step directory instead")
    if not is_megatron_checkpoint(step):
        raise ConfigError(f"{step} holds no {METADATA}: the save did not finish, or an older megatron-rl "
                          "wrote it; pass another step directory")
    return step


def weights_path(ckpt: str | Path) -> Path:
    """The directory of the torch_dist weight files of a checkpoint (its "weights_dir")."""
    return Path(ckpt) / read_metadata(ckpt).get("weights_dir", ".")


def check_intact(ckpt: Path) -> None:
    """Refuse a training checkpoint its MANIFEST.json disagrees with (a file missing, truncated
    or, where the manifest has checksums, corrupt). Others have no manifest: nothing to check."""
    if not (ckpt / MANIFEST).is_file():
        return
    from megatron_rl import checkpoint

    problem = checkpoint.verify(ckpt)
    if problem is not None:
        raise ConfigError(f"checkpoint {ckpt} is damaged: {problem}; use another checkpoint (e.g. an earlier "
                          "step_* directory of the run)")


def _check_intact_once(ckpt: Path) -> None:
    """check_intact on global rank 0 only (it may read every file), the verdict shared."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return check_intact(ckpt)
    verdict = [None]
    if dist.get_rank() == 0:
        try:
            check_intact(ckpt)
        except ConfigError as exc:
            verdict = [str(exc)]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise ConfigError(verdict[0])


def pin_checkpoint_vocab(config: RunConfig) -> RunConfig:
    """`config` with model.padded_vocab_size taken from checkpoint.init_from when that is a
    megatron-rl checkpoint and the size is not set: the padding depends on the TP size the
    checkpoint was saved at, and pinning it lets the checkpoint load at any other layout."""
    source = config.checkpoint.init_from
    if source is None or not names_megatron_checkpoint(source):
        return config
    return with_vocab_of(config, resolve_checkpoint(source))


def with_vocab_of(config: RunConfig, ckpt: Path) -> RunConfig:
    """`config` with model.padded_vocab_size set to the row count checkpoint `ckpt` recorded,
    unless the config sets it."""
    if config.model.padded_vocab_size is not None:
        return config
    rows = read_metadata(ckpt)["padded_vocab_size"]
    return dataclasses.replace(config, model=dataclasses.replace(config.model, padded_vocab_size=rows))


def load_initial_weights(policy, source: str | Path) -> None:
    """checkpoint.init_from into a built Policy: a megatron-rl checkpoint in any form
    `resolve_checkpoint` takes (saved at any layout; build the policy from
    `pin_checkpoint_vocab(config)`) or a Hugging Face model directory. Collective."""
    if names_megatron_checkpoint(source):
        ckpt = resolve_checkpoint(source)
        _check_intact_once(ckpt)
        weights = weights_path(ckpt)
        check_weight_files(weights)
        try:
            policy.load_model(str(weights))  # refreshes the optimizer's main weights too
        except Exception as exc:
            raise ConfigError(_unloadable(weights, exc)) from exc
    else:
        from megatron_rl.bridge import load_hf_weights

        load_hf_weights(policy.module, policy.arch, source)
        policy.optimizer.reload_model_params()


def read_metadata(ckpt: str | Path) -> dict:
    path = Path(ckpt) / METADATA
    if not path.is_file():
        raise ConfigError(f"{ckpt} is not a checkpoint written by megatron-rl ({METADATA} is missing)")
    try:
        metadata = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is unreadable ({exc}); {USE_ANOTHER}") from None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        found = metadata.get("format") if isinstance(metadata, dict) else metadata
        raise ConfigError(f"{path}: format {found!r} is not {FORMAT!r}")
    _check_weights_dir(Path(ckpt), metadata.get("weights_dir", "."))
    return metadata


def _check_weights_dir(ckpt: Path, relative) -> None:
    if not isinstance(relative, str) or Path(relative).is_absolute() or ".." in Path(relative).parts:
        raise ConfigError(f"{ckpt / METADATA}: weights_dir must be a path inside {ckpt}, got {relative!r}")
    if not (ckpt / relative).is_dir():
        raise ConfigError(f"{ckpt / METADATA}: weights_dir {relative!r} does not exist in {ckpt}: the "
                          f"checkpoint is incomplete; {USE_ANOTHER}")


def check_weight_files(weights: Path) -> None:
    """Every .distcp file the torch_dist index (.metadata) refers to exists and is long enough;
    a truncated file otherwise surfaces as a bare EOFError deep inside the loader."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(weights)).read_metadata().storage_data
    except Exception as exc:
        raise ConfigError(f"{weights / '.metadata'} is missing or unreadable ({_first_line(exc)}); "
                          f"{USE_ANOTHER}") from None
    needed: dict[str, int] = {}
    for item in storage.values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        file = weights / name
        if not file.is_file():
            raise ConfigError(f"{file} is missing from the checkpoint; {USE_ANOTHER}")
        if file.stat().st_size < size:
            raise ConfigError(f"{file} is truncated ({file.stat().st_size} bytes, the checkpoint's index needs "
                              f"{size}); {USE_ANOTHER}")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= 300 else text[:300] + "..."


def _unloadable(weights: Path, exc: BaseException) -> str:
    """One line for an exception of the torch_dist loader, naming the .distcp file if it says which."""
    text = "\n".join(str(e) for e in _chain(exc))
    file = re.search(r"[\w.-]+\.distcp", text)
    where = f" (file {weights / file.group(0)})" if file else ""
    return (f"cannot load the weights in {weights}{where}: {_first_line(exc)}. A file is corrupt, or the "
            f"checkpoint does not match its hf_config/; {USE_ANOTHER}")


def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _load_megatron_weights(module, weights: Path) -> None:
    """Collective: the model's weights from a torch_dist directory, with one-line errors that
    name the directory (and the file where it can be told) instead of the loader's traceback."""
    import torch
    from megatron.core import dist_checkpointing

    from megatron_rl.bridge.importer import first_error, non_finite

    try:
        with torch.no_grad():
            state = dist_checkpointing.load(module.sharded_state_dict(), str(weights))
    except Exception as exc:
        raise ConfigError(_unloadable(weights, exc)) from exc
    # torch_dist stores no checksum: NaN/infinite weights are the damage that can be seen.
    bad = next((name for name, value in state.items() if isinstance(value, torch.Tensor) and non_finite(value)), None)
    error = first_error(f"tensor {bad} in {weights} holds NaN or infinite values: a file is corrupt or "
                         f"the model diverged; {USE_ANOTHER}" if bad else None)
    if error:
        raise ConfigError(error)
    with torch.no_grad():
        module.load_state_dict(state)


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
    config = _config(hf_config, args, metadata["precision"], [f"model.padded_vocab_size={metadata['padded_vocab_size']}"])
    _preflight(config, args, "megatron-to-hf", argv, check_input=lambda: check_weight_files(weights_path(ckpt)),
               env={VERIFIED_ENV: str(ckpt.resolve())})

    from megatron_rl.bridge.hf_checkpoint import write_hf_checkpoint

    with _model_on_this_rank(config) as (runtime, built):
        _load_megatron_weights(built.module, weights_path(ckpt))
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
    # Quiet like the CLI (the tools scripts and the ranks torchrun starts come here directly);
    # MEGATRON_RL_VERBOSE=1 keeps the dependencies' warnings.
    if os.environ.get("MEGATRON_RL_VERBOSE") != "1":
        from megatron_rl.console import quiet_dependencies

        quiet_dependencies()
    try:
        with _signals_raise():
            COMMANDS[argv[0]](argv[1:])
    except ConfigError as exc:
        print(f"megatron-rl convert: {exc}", file=sys.stderr)
        return 2
    except Interrupted as exc:
        _stop_helper_processes()
        if not exc.reported and os.environ.get("RANK", "0") == "0":
            print(f"megatron-rl convert: stopped by {exc}; no output was published", file=sys.stderr)
        return 128 + exc.number
    return 0


if __name__ == "__main__":
    sys.exit(main())
