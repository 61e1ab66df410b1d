"""Can this run write where it will write? Checked before any model, process group or engine exists.

A run writes into OUTPUT_DIR (run.json, metrics.jsonl, run_state.json, the engine's model
directory, logs/, wandb/, the final hf_model/), OUTPUT_DIR/checkpoints (a directory per save and
`latest`) and rollout.staging_dir. Found unwritable only when first written, that cost a run its
work: a resume into an immutable checkpoints/ trained a step, then died at its first save.

Permission bits are not the answer: root ignores them, while an immutable file or directory
(chattr +i), a read-only mount or a path through a regular file refuse root too. So each place is
tried as the run will use it: a probe file is created and removed in every directory the run
writes into (in the nearest existing parent of one it has not made yet), and every existing file it
appends to or replaces is opened for appending (nothing is written to it).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from megatron_rl.errors import ConfigError, not_a_file

# Files of OUTPUT_DIR a run appends to or replaces, with what they hold (for the message).
RUN_FILES = {"metrics.jsonl": "every step's metrics", "run_state.json": "the last step done",
             "run.json": "the run's config", ".wandb_run_id": "the wandb run a resume continues",
             "learning_curve.png": "the learning curve"}


def run_outputs(config) -> list[tuple[Path, str]]:
    """(directory, what the run writes there) for every directory a `megatron-rl train` run of
    `config` writes into."""
    out = Path(config.output_dir)
    places = [(out, "the run's output directory: run.json, metrics.jsonl, run_state.json"),
              (out / "checkpoints", "the run's checkpoints"),
              (out / "engine_model", "the rollout engine's model directory"),
              (out / "logs", "the rollout servers' logs")]
    if config.logging.wandb_mode != "disabled":
        places.append((out / "wandb", "wandb's offline files"))
    if config.checkpoint.export_hf:
        places.append((out / "hf_model", "the final Hugging Face export"))
    staging = config.rollout.staging_dir
    places.append((Path(staging) if staging else out / ".weights", "the weight files pushed to rollout servers"
                   + (" (rollout.staging_dir)" if staging else "")))
    return places


def check_writable(config) -> None:
    """ConfigError naming the first place of run_outputs(config) (or file of RUN_FILES, or of
    checkpoints/latest) this process cannot write, before the run does any work."""
    out = Path(config.output_dir)
    for directory, what in run_outputs(config):
        problem = directory_problem(directory)
        if problem is not None:
            raise ConfigError(_message(directory, what, problem))
    files = [(out / name, what) for name, what in RUN_FILES.items()]
    files.append((out / "checkpoints" / "latest", "the name of the newest checkpoint"))
    files.extend((log, "a rollout server's log") for log in sorted((out / "logs").glob("*.log")))
    for path, what in files:
        problem = file_problem(path)
        if problem is not None:
            raise ConfigError(_message(path, what, problem))


def directory_problem(directory: Path) -> str | None:
    """Why a file cannot be created in `directory` (or, when it does not exist yet, in the
    nearest existing parent, where the run will create it), or None when it can."""
    target = directory
    while not target.exists() and target != target.parent:
        if target.is_symlink():  # a dangling link: the run would fail to create through it
            return f"{target} is a symbolic link to nothing ({os.readlink(target)})"
        target = target.parent
    if not target.is_dir():
        return f"{target} is not a directory"
    try:
        handle, probe = tempfile.mkstemp(prefix=".megatron-rl-write-probe-", dir=target)
    except OSError as exc:
        return f"creating a file in {target} failed: {exc.strerror or exc}"
    os.close(handle)
    try:
        os.unlink(probe)
    except OSError as exc:
        return f"a file created in {target} cannot be removed: {exc.strerror or exc}"
    return None


def file_problem(path: Path) -> str | None:
    """Why the existing file `path` cannot be appended to or replaced, or None (also when it does
    not exist: its directory is probed by directory_problem)."""
    if not path.exists():
        return None
    problem = not_a_file(path)  # a FIFO would block the open below (and every write of the run) forever
    if problem is not None:
        return f"{path} {problem}"
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        return f"opening it for writing failed: {exc.strerror or exc}"
    return None


def _message(path: Path, what: str, problem: str) -> str:
    return (f"cannot write {path} ({what}): {problem}. The run would do its work and then fail writing there; "
            f"make it writable (an immutable file or directory: lsattr, chattr -i; a read-only mount; permissions) "
            f"or pass another --output-dir")
