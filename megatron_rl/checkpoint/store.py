"""One checkpoint on disk: write it (synchronously or in the background), verify it, load it.

    OUTPUT_DIR/checkpoints/
        step_000020/
            weights/             torch_dist: the model, Adam's moments (and fp32 main weights of a
                                 bf16 model) and the KL reference weights, every per-parameter
                                 tensor sharded like its weight: loads at any TP/PP/EP/DP layout.
                                 A LoRA run's leaves its frozen base out and megatron_rl.json
                                 names it (checkpoint/base_check.py; checkpoint.base_weights)
            rng/rank_00000.pt    python, numpy, torch CPU/CUDA and Megatron's CUDA RNG tracker, as
                                 tensors and plain values (read with weights_only=True)
            hf_config/           config.json and tokenizer files: the checkpoint describes its model
            megatron_rl.json     format tag, padded vocabulary size, layout and precision
                                 (what `megatron-rl convert megatron-to-hf` and init_from read)
            trainer_state.json   step, data cursor, LR schedule and Adam step, seed, config
            MANIFEST.json        every file with its size and CRC-32; written last
        step_000030/ ...
        latest                   the name of the newest complete checkpoint

A checkpoint is written into a hidden staging directory `.step_000020.partial-<id>` and renamed
into place only when every rank has finished and the manifest is written; then `latest` is
replaced atomically and checkpoints beyond `keep_last` are deleted, oldest first.

Asynchronous saves: Megatron-Core plans the save (collectives, a fraction of a second), then a
forked process per rank writes the files while training continues. The fork is the snapshot:
the child sees the weights as they were when it started (copy-on-write), so the training
steps that follow cannot tear the checkpoint (on CPU, Megatron-Core's own "preload" makes no
copy). Each writer checksums the files it wrote; `PendingCheckpoint.poll()` at a step boundary
finalizes the save on all ranks together and publishes it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.checkpoint.manifest import MANIFEST, _write_json, file_crc32, read_manifest, verify_files, write_manifest  # noqa: F401  (store's callers use them from here too)
from megatron_rl.checkpoint.write_results import start_write_results_queue  # noqa: F401  (also used from here)
from megatron_rl.checkpoint.rng_state import capture_rng, restore_rng  # noqa: F401  (also used from here)
from megatron_rl.checkpoint.locate import latest_name
from megatron_rl.checkpoint.unpickling import read_rng_state
from megatron_rl.errors import ConfigError, TrainingStopped

STATE = "trainer_state.json"
LATEST = "latest"
STATE_VERSION = 2  # 1: optimizer saved dp_reshardable, reference weights as per-rank files


@dataclass
class SaveStats:
    step: int
    bytes: int = 0
    blocked_s: float = 0.0  # the training loop waited this long for the save (both modes)
    write_s: float = 0.0  # writing the files (in the background when asynchronous)
    checksum_s: float = 0.0  # CRC-32 of every file (measured where the files were written)
    path: Path | None = None


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


@dataclass
class PendingCheckpoint:
    """A save in progress. Collective methods: every rank calls them at the same points."""

    root: Path
    final: Path
    staging: Path
    request: Any  # Megatron-Core's AsyncRequest
    describe: dict[str, Any]  # rank 0: {"state": ..., "metadata": ..., "hf_files": {name: bytes}}
    keep_last: int
    device: torch.device
    stats: SaveStats
    process: Any = None  # the forked writer (asynchronous mode)
    report: Any = None  # the reading end of a pipe on which the forked writer sends why it failed
    started: float = field(default_factory=time.perf_counter)

    def poll(self, blocking: bool) -> bool:
        """True once the checkpoint is published (on every rank). Without `blocking`, returns
        False at once if any rank's writer is still running."""
        tick = time.perf_counter()
        running = torch.tensor(int(self.process is not None and self.process.is_alive()), device=self.device)
        dist.all_reduce(running, op=dist.ReduceOp.MAX)
        if int(running) and not blocking:
            return False
        if self.process is not None:
            self.process.join()
            problem = None
            if self.process.exitcode != 0:
                sent = self.report.recv() if self.report is not None and self.report.poll() else None
                problem = sent or f"the writer process exited with code {self.process.exitcode}"
            problem = agreed_problem(problem)
            if problem is not None:
                self.abandon()
                raise save_failed(self.final, problem)
        self._finalize()
        self.stats.blocked_s += time.perf_counter() - tick
        return True

    def abandon(self) -> None:
        if dist.get_rank() == 0:
            shutil.rmtree(self.staging, ignore_errors=True)

    def _finalize(self) -> None:
        """Collective. A write that failed on any rank (torch gathers the writers' errors into a
        CheckpointException on every rank; rank 0's own files) stops the run with one line on every
        rank, the staging directory removed and the previous checkpoint still the latest."""
        from torch.distributed.checkpoint.api import CheckpointException

        problem, mine = None, {"files": {}, "write_s": 0.0, "checksum_s": 0.0}
        try:
            for finalize in self.request.finalize_fns:  # gathers write results, writes torch_dist metadata
                finalize()
            mine = _read_side_checksums(self.staging)
        except (OSError, CheckpointException) as exc:
            problem = one_line(exc)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (mine, problem))
        problem = next((part[1] for part in gathered if part[1]), None)
        if dist.get_rank() == 0 and problem is None:
            try:
                self._publish_described([part[0] for part in gathered])
            except OSError as exc:
                problem = one_line(exc)
        problem = agreed_problem(problem)  # also the barrier after rank 0 published
        if problem is not None:
            self.abandon()
            raise save_failed(self.final, problem)
        self.stats.path = self.final

    def _publish_described(self, gathered: list[dict]) -> None:
        """Rank 0: the description and the manifest written, the checkpoint renamed into place,
        `latest` replaced, the oldest pruned."""
        checksums: dict[str, dict] = {}
        write_s = checksum_s = 0.0
        for part in gathered:
            checksums.update(part["files"])
            write_s, checksum_s = max(write_s, part["write_s"]), max(checksum_s, part["checksum_s"])
        self._write_description()
        tick = time.perf_counter()
        files = write_manifest(self.staging, known=checksums, step=self.stats.step)
        checksum_s += time.perf_counter() - tick
        _publish(self.staging, self.final)
        _replace_file(self.root / LATEST, self.final.name + "\n")
        _prune(self.root, self.keep_last)
        self.stats.bytes = sum(entry["bytes"] for entry in files.values())
        self.stats.write_s, self.stats.checksum_s = write_s, checksum_s

    def _write_description(self) -> None:
        """Rank 0: the small files that describe the checkpoint."""
        _write_json(self.staging / STATE, self.describe["state"])
        _write_json(self.staging / "megatron_rl.json", self.describe["metadata"])
        (self.staging / "hf_config").mkdir(exist_ok=True)
        for name, content in self.describe["hf_files"].items():
            (self.staging / "hf_config" / name).write_bytes(content)


def begin_save(root: Path, step: int, policy, trainer_state: dict[str, Any], *, keep_last: int,
               keyed_like_weights: dict, metadata: dict, hf_files: dict[str, bytes], async_save: bool,
               device: torch.device) -> PendingCheckpoint:
    """Collective. Starts writing checkpoint `step`; with `async_save` the files are written by a
    forked process and the caller must `poll()` the result at later step boundaries (the
    training loop continues meanwhile). Otherwise the checkpoint is published on return."""
    root = Path(root)
    start_write_results_queue()
    tick = time.perf_counter()
    final = root / checkpoint_name(step)
    name = [f".{final.name}.partial-{uuid.uuid4().hex[:8]}"]
    dist.broadcast_object_list(name, src=0)
    staging = root / name[0]
    # A directory that cannot be written (immutable, read-only, full) stops the run here with one
    # line on every rank, the checkpoints before this one kept (preflight tried these places at
    # start: this is what happens when they break during the run).
    problem = None
    if dist.get_rank() == 0:
        try:
            staging.mkdir(parents=True)
        except OSError as exc:
            problem = one_line(exc)
    problem = agreed_problem(problem)  # also the barrier before any rank writes into staging
    if problem is not None:
        raise save_failed(final, problem)
    try:
        small, request = policy.save_training_state(str(staging / "weights"), keyed_like_weights=keyed_like_weights,
                                                    async_save=True, without_frozen="base" in metadata)
        (staging / "rng").mkdir(exist_ok=True)
        torch.save(capture_rng(), staging / "rng" / f"rank_{dist.get_rank():05d}.pt")
    except OSError as exc:
        problem = one_line(exc)
    _raise_if_failed(agreed_problem(problem), staging, final)
    state = dict(trainer_state, step=step, policy=small, world_size=dist.get_world_size(), version=STATE_VERSION,
                 keyed_like_weights=sorted(keyed_like_weights))
    describe = {"state": state, "metadata": dict(metadata, step=step), "hf_files": hf_files}
    pending = PendingCheckpoint(root, final, staging, request, describe, keep_last, device, SaveStats(step))
    writer = _checksummed_writer(request, staging)
    if async_save:
        args = _preloaded_args(request)
        fork = multiprocessing.get_context("fork")
        pending.report, sender = fork.Pipe(duplex=False)
        pending.process = fork.Process(target=_write_in_child, args=(writer, sender, *args))
        pending.process.start()
        sender.close()
        pending.stats.blocked_s = time.perf_counter() - tick
        return pending
    try:
        writer(*_preloaded_args(request))
    except OSError as exc:
        problem = one_line(exc)
    _raise_if_failed(agreed_problem(problem), staging, final)
    pending.stats.blocked_s = time.perf_counter() - tick
    pending.poll(blocking=True)
    return pending


def _raise_if_failed(problem: str | None, staging: Path, final: Path) -> None:
    if problem is None:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
    raise save_failed(final, problem)


def _write_in_child(writer, report, *args) -> None:
    """The forked writer's body: why it failed is sent to the trainer (which reports it in one
    line, on every rank) instead of a traceback on stderr."""
    try:
        writer(*args)
    except BaseException as exc:  # noqa: BLE001 - whatever it is, the trainer reports it
        report.send(one_line(exc))
        report.close()
        sys.exit(1)


def agreed_problem(problem: str | None) -> str | None:
    """Collective: the first rank's problem, on every rank (None when no rank has one)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return problem
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problem)
    return next((p for p in gathered if p), None)


def one_line(exc: BaseException) -> str:
    """A failed write in one line: the OSError behind it (disk full, permission, read-only) where
    there is one, in the exception's chain or among the rank errors torch gathered into a
    CheckpointException (whose own text is a multi-line traceback), else its first line."""
    candidates = [exc, *(error for error, _ in (getattr(exc, "failures", None) or {}).values())]
    for candidate in candidates:
        link, seen = candidate, set()
        while link is not None and id(link) not in seen:
            if isinstance(link, OSError):
                return f"{type(link).__name__}: {link}"
            seen.add(id(link))
            link = link.__cause__ or link.__context__
    first = candidates[-1]
    lines = str(first).strip().splitlines()
    return f"{type(first).__name__}: {lines[0]}" if lines else type(first).__name__


def save_failed(final: Path, problem: str) -> TrainingStopped:
    """The run's stop when checkpoint `final` could not be written: what failed, what is kept."""
    latest = final.parent / LATEST
    try:
        kept = latest_name(latest)
    except (OSError, ConfigError):
        kept = None
    kept = (f"the checkpoints before it are kept ({final.parent / kept} is the latest)" if kept else
            "no earlier checkpoint of this run exists")
    return TrainingStopped(f"checkpoint {final.name} could not be written into {final.parent}: {problem}. The run "
                           f"stops here; {kept}. Free space or make the directory writable, then run the same "
                           f"command to resume")


def _preloaded_args(request) -> list:
    args = list(request.async_fn_args)
    if request.preload_fn is not None:
        args[1] = request.preload_fn()  # device tensors staged to host; on CPU the fork snapshots them
    return args


class _checksummed_writer:
    """Runs Megatron-Core's file writer, then CRC-32s the files it wrote (still in the page
    cache) and leaves them in a side file for rank 0's manifest. A class, not a closure, so a
    forked process can run it."""

    def __init__(self, request, staging: Path):
        self.request, self.staging = request, staging

    def __call__(self, *args) -> None:
        tick = time.perf_counter()
        written = []
        if self.request.async_fn is not None:
            self.request.async_fn(*args)
            written = sorted({bucket[0] for bucket in args[1]})  # WriteBucket: (file name, key, data)
        write_s = time.perf_counter() - tick
        tick = time.perf_counter()
        files = {}
        for file in written:
            path = Path(file)
            files[str(path.relative_to(self.staging))] = {"bytes": path.stat().st_size, "crc32": file_crc32(path)}
        rank = dist.get_rank() if dist.is_initialized() else 0
        _write_json(self.staging / f".checksums_rank{rank:05d}.json",
                    {"files": files, "write_s": write_s, "checksum_s": time.perf_counter() - tick})


def _read_side_checksums(staging: Path) -> dict:
    path = staging / f".checksums_rank{dist.get_rank():05d}.json"
    if not path.is_file():  # this rank had nothing to write
        return {"files": {}, "write_s": 0.0, "checksum_s": 0.0}
    value = json.loads(path.read_text())
    path.unlink()
    return value


def _publish(staging: Path, final: Path) -> None:
    """Rename into place; a checkpoint of the same step (a resumed run re-reaching it) is
    replaced only after the new one is complete."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        final.rename(old)
    staging.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Verifying
# ---------------------------------------------------------------------------------------------


def verify(path: Path, checksums: bool = True, share: tuple[int, int] = (0, 1)) -> str | None:
    """None if the checkpoint is complete and intact, else what is wrong with it (naming the
    file). `checksums=False`: sizes only (fast). `share=(i, n)`: check only every n-th file from
    the i-th (ranks split the reading); the small files are always checked."""
    problem = verify_files(path, checksums=checksums, share=share)
    if problem is not None:
        return problem
    try:
        state = json.loads((path / STATE).read_text())
    except (OSError, ValueError, RecursionError) as exc:
        return f"{STATE} is unreadable ({exc})"
    if not isinstance(state, dict):
        return f"{STATE} is not the JSON object a run writes (a {type(state).__name__})"
    if state.get("version") != STATE_VERSION:
        return (f"written by an older megatron-rl (checkpoint format {state.get('version', 1)}, this one reads "
                f"{STATE_VERSION}); convert it with that version or start over")
    return _state_problem(state)


# The trainer state's keys that a resume reads first, with the least value of a count (None: an
# object). Only "step" is required: a state saved by other code than the trainer's has no others.
_STATE_KINDS = {"step": 0, "world_size": 1, "policy": None, "sampler": None, "config": None}


def _state_problem(state: dict) -> str | None:
    """What is wrong with a trainer state's keys a resume reads (by type and bound), or None."""
    for key, least in _STATE_KINDS.items():
        value = state.get(key)
        if value is None and key != "step":
            continue
        if least is None and not isinstance(value, dict):
            return f"{STATE}: {key!r} must be an object, not {json.dumps(value)[:40]}"
        if least is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            return f"{STATE}: {key!r} must be an integer >= {least}, not {json.dumps(value)[:40]}"
    return None


def candidates(root: Path) -> list[Path]:
    """Checkpoint directories under `root`, newest first (`latest` first if it names one)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")),
                   key=lambda p: p.name, reverse=True)
    latest = root / LATEST
    if latest.is_file():
        try:
            named = root / latest_name(latest)
        except ConfigError:  # damaged (not UTF-8, oversized): the names' order alone, and verify() decides
            named = None
        if named in found:
            found.remove(named)
            found.insert(0, named)
    return found


def find_resumable(root: Path, checksums: bool = True) -> tuple[Path | None, list[str]]:
    """The newest intact checkpoint under `root` (None if there is none), and the skipped ones
    with the reason. Collective when a process group exists."""
    skipped: list[str] = []
    for candidate in candidates(root):
        problem = verify_shared(candidate, checksums=checksums)
        if problem is None:
            return candidate, skipped
        skipped.append(f"{candidate}: {problem}")
    return None, skipped


def verify_shared(path: Path, checksums: bool = True) -> str | None:
    """verify() with the reading split over the ranks of the process group (if there is one);
    every rank gets the same answer."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return verify(path, checksums=checksums)
    problem = verify(path, checksums=checksums, share=(dist.get_rank(), dist.get_world_size()))
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p), None)


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def load_checkpoint(path: Path, policy, keyed_like_weights: tuple[str, ...] = (),
                    without_frozen: bool = False) -> tuple[dict[str, Any], dict]:
    """Collective: restores model, optimizer, LR schedule and (same world size) this rank's RNG,
    at this layout whatever layout wrote it. Returns the trainer state and the per-parameter
    tensors asked for ({prefix: {name: tensor}}; a prefix the checkpoint lacks is left out).
    `without_frozen`: a LoRA checkpoint that refers to its base, loaded into `policy` before
    (checkpoint/manager.py load_training_checkpoint)."""
    from megatron.core.dist_checkpointing.core import CheckpointingException

    state = json.loads((path / STATE).read_text())
    if state.get("world_size") != dist.get_world_size() and dist.get_rank() == 0:
        print(f"resume: checkpoint was written by {state.get('world_size')} ranks, now {dist.get_world_size()}; "
              "weights, optimizer state and reference weights are resharded, the per-rank RNG streams are "
              "re-seeded (sampling will not repeat the original run exactly)")
    saved_prefixes = tuple(p for p in keyed_like_weights if p in state.get("keyed_like_weights", []))
    try:
        extra = policy.load_training_state(str(path / "weights"), state["policy"], keyed_like_weights=saved_prefixes,
                                           without_frozen=without_frozen)
    except CheckpointingException as exc:
        raise RuntimeError(f"checkpoint {path} could not be loaded: {exc}") from exc
    rng_file = path / "rng" / f"rank_{dist.get_rank():05d}.pt"
    if rng_file.is_file() and state.get("world_size") == dist.get_world_size():
        restore_rng(read_rng_state(rng_file))
    return state, extra


# ---------------------------------------------------------------------------------------------


def _replace_file(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def _prune(root: Path, keep_last: int) -> None:
    """Delete complete checkpoints beyond the newest `keep_last`. Each is renamed aside first (a
    checkpoint is never half-deleted under its own name), then deleted by a background thread:
    unlinking gigabytes takes a while and is no reason to hold up training. A leftover from a
    process that exited meanwhile is removed at the next start (CheckpointManager.prepare)."""
    complete = sorted(p for p in root.iterdir()
                      if p.is_dir() and p.name.startswith("step_") and verify(p, checksums=False) is None)
    for old in complete[:-keep_last] if keep_last > 0 else []:
        aside = old.with_name(f".{old.name}.old-{uuid.uuid4().hex[:8]}")
        old.rename(aside)
        threading.Thread(target=shutil.rmtree, args=(aside,), kwargs={"ignore_errors": True}, daemon=True).start()
