"""Save and resume everything an exact continuation needs; never leave a half-written checkpoint.

    OUTPUT_DIR/checkpoints/
        step_000020/
            weights/                 torch_dist: model + optimizer (moments, fp32 main weights)
            rng/rank_00000.pt        python, numpy, torch CPU/CUDA and Megatron's CUDA RNG tracker
            trainer_state.json       step, data cursor, LR schedule and Adam step, seed, config
            MANIFEST.json            every file with its size; written last
        step_000030/ ...
        latest                       the name of the newest complete checkpoint

A checkpoint is written into a hidden staging directory and renamed into place only after every
rank finished (megatron_rl.atomic_dir), then `latest` is replaced atomically and checkpoints
beyond `keep_last` are deleted, oldest first. On resume, a checkpoint whose manifest is missing or
disagrees with the files (a crash during a copy, a truncated file) is reported by name and the
previous one is used.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.atomic_dir import AtomicDirectory

MANIFEST = "MANIFEST.json"
STATE = "trainer_state.json"
LATEST = "latest"


@dataclass
class Resumed:
    path: Path
    state: dict[str, Any]  # the trainer_state.json content
    skipped: list[str]  # checkpoints found unusable, with the reason


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def save_checkpoint(root: Path, step: int, policy, trainer_state: dict[str, Any], keep_last: int) -> Path:
    """Collective: every rank calls it. Returns the published checkpoint directory."""
    root = Path(root)
    final = root / checkpoint_name(step)
    rank = dist.get_rank()
    # A checkpoint of the same step can exist when a run resumed from an earlier one re-reaches it.
    with AtomicDirectory(final, force=True) as staging:
        policy_state = policy.save_training_state(str(staging / "weights"))
        (staging / "rng").mkdir(exist_ok=True)
        torch.save(capture_rng(), staging / "rng" / f"rank_{rank:05d}.pt")
        dist.barrier()
        if rank == 0:
            state = dict(trainer_state, step=step, policy=policy_state, world_size=dist.get_world_size())
            _write_json(staging / STATE, state)
            _write_json(staging / MANIFEST, {"step": step, "files": _inventory(staging)})
    if rank == 0:
        _replace_file(root / LATEST, final.name + "\n")
        _prune(root, keep_last)
    dist.barrier()
    return final


def find_resumable(root: Path) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint under `root` (None if there is none), and the skipped ones.

    Candidates are tried newest first: `latest` first if it names one, then the step_* directories."""
    root = Path(root)
    skipped: list[str] = []
    if not root.is_dir():
        return None, skipped
    candidates = sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")),
                        key=lambda p: p.name, reverse=True)
    latest = root / LATEST
    if latest.is_file():
        named = root / latest.read_text().strip()
        if named in candidates:
            candidates.remove(named)
            candidates.insert(0, named)
    for candidate in candidates:
        problem = verify(candidate)
        if problem is None:
            return candidate, skipped
        skipped.append(f"{candidate}: {problem}")
    return None, skipped


def verify(path: Path) -> str | None:
    """None if the checkpoint is complete, else what is wrong with it."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return f"no {MANIFEST} (the save did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        return f"{MANIFEST} is unreadable ({exc})"
    for relative, size in files.items():
        file = path / relative
        if not file.is_file():
            return f"missing file {relative}"
        if file.stat().st_size != size:
            return f"file {relative} has {file.stat().st_size} bytes, the manifest says {size}"
    try:
        json.loads((path / STATE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return f"{STATE} is unreadable ({exc})"
    return None


def load_checkpoint(path: Path, policy) -> dict[str, Any]:
    """Collective: restores model, optimizer, LR schedule and this rank's RNG; returns the trainer state."""
    state = json.loads((path / STATE).read_text())
    if state.get("world_size") != dist.get_world_size():
        # Weights and optimizer reshard (torch_dist, dp_reshardable); per-rank RNG streams cannot.
        rng_note = "per-rank RNG streams are re-seeded, so sampling will not repeat the original run exactly"
        if dist.get_rank() == 0:
            print(f"resume: checkpoint was written by {state.get('world_size')} ranks, now {dist.get_world_size()}; {rng_note}")
    policy.load_training_state(str(path / "weights"), state["policy"])
    rng_file = path / "rng" / f"rank_{dist.get_rank():05d}.pt"
    if rng_file.is_file() and state.get("world_size") == dist.get_world_size():
        restore_rng(torch.load(rng_file, weights_only=False))
    return state


def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
        from megatron.core import tensor_parallel

        state["megatron_cuda_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_cuda_tracker"])


def _inventory(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_size
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST}


def _write_json(path: Path, value: Any) -> None:
    with open(path, "w") as handle:
        json.dump(value, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())


def _replace_file(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def _prune(root: Path, keep_last: int) -> None:
    complete = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and verify(p) is None)
    for old in complete[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
