"""The one owner of a run's checkpoints: the folder, the cadence, which checkpoint a run resumes
from, the initial weights, the KL reference weights, and the final export as a HF model.

    OUTPUT_DIR/
        run.json            the config of the run that owns this directory
        checkpoints/        step_*/ and `latest` (megatron_rl.checkpoint.store describes one)
        hf_model/           the final policy as a Hugging Face model (checkpoint.export_hf)
        previous-<time>/    an earlier run's checkpoints and logs, moved aside by resume=none

Start-up, in order: `check_run_directory` (preflight, no torch: refuses a resume into a run with
another config, or when no checkpoint is complete), then on the trainer's ranks `prepare()`
(moves an earlier run aside when starting over), `choose()` (the newest checkpoint that
verifies, checksums included), `policy_config()` (the padded vocabulary of the checkpoint the
weights come from: Megatron pads it to a multiple of 128 x TP, so another TP would not fit),
then `load(policy, chosen)` (that checkpoint, else the initial weights).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl.algorithms.from_config import recipe_for
from megatron_rl.checkpoint.config_change import check_same_run
from megatron_rl.config import RunConfig, to_dict
from megatron_rl.errors import ConfigError, TrainingStopped

RUN_RECORD = "run.json"
HF_EXPORT = "hf_model"
# What an earlier run leaves in its output directory (moved aside together by resume=none).
RUN_ARTIFACTS = ("checkpoints", "metrics.jsonl", "run_state.json", RUN_RECORD, "learning_curve.png", HF_EXPORT,
                 "wandb", "wandb_run_id")


# ---------------------------------------------------------------------------------------------
# Preflight: fast, no torch, no process group
# ---------------------------------------------------------------------------------------------


def check_run_directory(config: RunConfig) -> None:
    """Refuse, before any expensive work: resuming with a config that differs from the recorded
    one; resume=auto when checkpoints exist but none is complete; resume=PATH that is not one."""
    from megatron_rl.checkpoint import store as ckpt

    setting, root = config.checkpoint.resume, Path(config.output_dir) / "checkpoints"
    if setting == "none":
        return
    if setting != "auto":
        problem = ckpt.verify(Path(setting), checksums=False)
        if problem:
            raise ConfigError(f"checkpoint.resume: {setting}: {problem}")
        check_same_run(config, Path(setting))
        check_unpickled_files(Path(setting))
        check_base_present(Path(setting))
        return
    found = ckpt.candidates(root)
    if not found:
        return
    verdicts = [(path, ckpt.verify(path, checksums=False)) for path in found]
    usable = [path for path, problem in verdicts if problem is None]
    if not usable:
        raise ConfigError(unusable_message(root, [f"{path}: {problem}" for path, problem in verdicts]))
    check_same_run(config, usable[0])
    check_unpickled_files(usable[0])  # a file that would run code on resume: refused, not skipped
    check_base_present(usable[0])


def check_unpickled_files(path: Path) -> None:
    """Collective when a process group exists: ConfigError on every rank (naming the file) when
    any file of checkpoint `path` that is unpickled on load, on any rank, names a callable that
    would run (checkpoint/unpickling.py). Before anything is loaded."""
    import torch.distributed as dist

    from megatron_rl.checkpoint.format import check_weight_files
    from megatron_rl.checkpoint.unpickling import read_rng_state

    problem = None
    try:
        for rng_file in sorted((path / "rng").glob("rank_*.pt")):
            read_rng_state(rng_file)
        check_weight_files(path / "weights")
    except ConfigError as exc:
        problem = str(exc)
    if dist.is_initialized() and dist.get_world_size() > 1:
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p), None)
    if problem:
        raise ConfigError(problem)


def load_training_checkpoint(path: Path, policy, keyed_like_weights: tuple[str, ...] = ()):
    """Collective: store.load_checkpoint, the base loaded first for a LoRA checkpoint that refers
    to its base (checkpoint/base_check.py). Returns what store.load_checkpoint returns."""
    from megatron_rl.checkpoint import store
    from megatron_rl.checkpoint.base_check import refers_to_base
    from megatron_rl.checkpoint.format import load_referenced_base, read_metadata

    metadata = read_metadata(path)
    if refers_to_base(metadata):
        load_referenced_base(policy, metadata["base"], path)
    return store.load_checkpoint(path, policy, keyed_like_weights, without_frozen=refers_to_base(metadata))


def check_base_present(path: Path) -> None:
    """A LoRA checkpoint's base (checkpoint/base_check.py) is there with the sizes the run read;
    its checksums are compared when it is loaded."""
    from megatron_rl.checkpoint.base_check import base_problem, refers_to_base, refused
    from megatron_rl.checkpoint.format import METADATA

    try:
        metadata = json.loads((path / METADATA).read_text())
    except (OSError, ValueError):
        return  # not this check's business: loading the checkpoint names what is wrong with it
    problem = base_problem(metadata["base"], path, checksums=False) if refers_to_base(metadata) else None
    if problem:
        raise refused(path, problem)


def unusable_message(root: Path, problems: list[str]) -> str:
    listing = "\n  ".join(problems)
    return (f"checkpoint.resume=auto: no checkpoint in {root} can be used:\n  {listing}\n"
            "To start over in this directory, run with checkpoint.resume=none: the old checkpoints and "
            "metrics are moved into previous-<time>/ (nothing is deleted). Or resume from a checkpoint "
            "elsewhere with checkpoint.resume=PATH.")


# ---------------------------------------------------------------------------------------------


@dataclass
class Resumed:
    path: Path
    step: int
    state: dict[str, Any]  # trainer_state.json


class CheckpointManager:
    """Collective methods (every rank calls them at the same points): prepare, choose, load,
    after_step, close(clean=True), export_hf."""

    def __init__(self, config: RunConfig, runtime, *, model_dir: Path):
        """`model_dir`: the run's model description (config.json and tokenizer files), copied
        into every checkpoint and the HF export so that each describes its model."""
        self.config, self.runtime = config, runtime
        self.policy = None  # given to load()
        self.out = Path(config.output_dir)
        self.root = self.out / "checkpoints"
        self.model_dir = Path(model_dir)
        self.is_driver = runtime.rank == 0
        self.reference = None  # ReferenceWeights, when the recipe has a KL term
        self.pending = None  # a save being written in the background
        self.base = None  # the frozen base the checkpoints refer to (checkpoint/base_check.py)

    # ---- start-up -------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Rank 0 tidies the directory before anyone reads it: staging directories of a save
        that crashed are removed; starting over (resume=none) moves an earlier run aside."""
        from megatron_rl.checkpoint.store import agreed_problem, one_line, start_write_results_queue

        start_write_results_queue()  # now, not at the first save (see there)
        problem = None
        if self.is_driver:
            try:
                self._tidy()
            except OSError as exc:  # preflight tried these places: they broke since
                problem = one_line(exc)
        problem = agreed_problem(problem)  # also the barrier: nobody reads the directory before it is tidy
        if problem is not None:
            raise ConfigError(f"cannot prepare the run directory {self.out}: {problem}; make it writable or pass "
                              "another --output-dir")

    def _tidy(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in list(self.root.glob(".step_*.partial-*")) + list(self.root.glob(".step_*.old-*")):
            shutil.rmtree(stale, ignore_errors=True)
            print(f"checkpoints: removed {stale.name}, left by a save that did not finish")
        if self.config.checkpoint.resume == "none" or not _complete_candidates(self.root):
            self._move_earlier_run_aside()
        (self.out / RUN_RECORD).write_text(json.dumps({"config": to_dict(self.config)}, indent=1))

    def _move_earlier_run_aside(self) -> None:
        present = [self.out / name for name in RUN_ARTIFACTS if (self.out / name).exists()]
        if self.root.is_dir() and not any(self.root.iterdir()):
            present = [p for p in present if p != self.root]
        if not [p for p in present if p.name != RUN_RECORD]:
            return
        target = self.out / f"previous-{time.strftime('%Y%m%d-%H%M%S')}"
        target.mkdir()
        for path in present:
            path.rename(target / path.name)
        self.root.mkdir(parents=True, exist_ok=True)
        print(f"starting over: the earlier run's {', '.join(p.name for p in present)} moved into {target} "
              "(nothing deleted)")

    def choose(self) -> Path | None:
        """The checkpoint to continue from (verified, checksums included), or None to start from
        the initial weights. A checkpoint that fails verification is named and the previous one
        is used; if none is usable, resume=auto refuses."""
        from megatron_rl.checkpoint import store as ckpt

        setting = self.config.checkpoint.resume
        if setting == "none":
            return None
        if setting == "auto":
            path, skipped = ckpt.find_resumable(self.root)
            for problem in skipped:
                self._say(f"resume: skipping unusable checkpoint {problem}")
            if path is None and skipped:
                raise ConfigError(unusable_message(self.root, skipped))
            return path
        path = Path(setting)
        problem = ckpt.verify_shared(path)
        if problem:
            raise ConfigError(f"checkpoint.resume: {path}: {problem}")
        return path

    def policy_config(self, chosen: Path | None) -> RunConfig:
        """The config to build the policy from: model.padded_vocab_size pinned to the row count of
        the checkpoint its weights will come from (the chosen one, else checkpoint.init_from),
        unless the config sets it."""
        from megatron_rl.checkpoint.format import pin_checkpoint_vocab, with_vocab_of

        return pin_checkpoint_vocab(self.config) if chosen is None else with_vocab_of(self.config, chosen)

    def load(self, policy, chosen: Path | None) -> Resumed | None:
        """Collective: the chosen checkpoint into `policy` (model, optimizer, schedule, RNG, KL
        reference), or, with none chosen, the initial weights."""
        self.policy = policy
        path = chosen
        if path is None:
            self._load_initial_weights()
            if self._refers_to_base:
                self.base = self._base_of_initial_weights()
            return None
        prefixes = ("reference",) if self._uses_kl else ()
        check_unpickled_files(path)  # every rank refuses together, before anything is loaded
        state, extra = load_training_checkpoint(path, self.policy, keyed_like_weights=prefixes)
        if "reference" in extra:
            from megatron_rl.model.reference import ReferenceWeights

            self.reference = ReferenceWeights(extra["reference"])
        if self._refers_to_base:
            self.base = self._base_of_checkpoint(path)
        return Resumed(path, state["step"], state)

    # ---- a LoRA run's base (checkpoint/base_ref.py, base_check.py) --------------------------------

    @property
    def _refers_to_base(self) -> bool:
        return self.config.model.lora is not None and self.config.checkpoint.base_weights == "referenced"

    def _base_of_initial_weights(self):
        """Collective: checkpoint.init_from described, or the base written into checkpoints/base/
        (random initialization: nothing else holds it)."""
        import torch.distributed as dist

        from megatron_rl.checkpoint import base_ref

        source = self.config.checkpoint.init_from
        if source is None:
            return self._write_own_base()
        described = [base_ref.describe_source(source) if self.is_driver else None]
        dist.broadcast_object_list(described, src=0)
        return described[0]

    def _base_of_checkpoint(self, path: Path):
        """Collective: the base the resumed checkpoint refers to, named as this run's checkpoints
        will name it; for a checkpoint that holds its base (written with base_weights=saved) the
        base as loaded from it, written into checkpoints/base/."""
        from megatron_rl.checkpoint.base_check import portable, refers_to_base
        from megatron_rl.checkpoint.format import read_metadata

        metadata = read_metadata(path)
        if refers_to_base(metadata):
            return portable(metadata["base"], path, self.root)
        return self._write_own_base()

    def _write_own_base(self) -> dict:
        """Collective: the policy's frozen base written into checkpoints/base/, named as the step
        directories beside it name it (../base)."""
        from megatron_rl.checkpoint import base_ref

        base = base_ref.write_base(self.policy, self.root, self.config, self.model_dir)
        return base_ref.describe_written(base, relative_to=self.root / "step_000000")

    def _keep_base(self, step: int) -> None:
        """Collective, before each checkpoint that refers to the base: the base is still there,
        every file with the size the run read (cheap: no file is read; the CRC-32s are compared
        when a resume loads it). If not, the run's own base (checkpoints/base: written from the
        frozen weights, which the run still holds) is written again and the checkpoints refer to
        that; any other base (checkpoint.init_from's) stops the run here, before it writes a
        checkpoint that no resume could load, its checkpoints so far kept."""
        if self.base is None:
            return
        import torch.distributed as dist

        from megatron_rl.checkpoint.base_check import base_problem
        from megatron_rl.checkpoint.store import checkpoint_name

        problem = [base_problem(self.base, self.root / checkpoint_name(step), checksums=False) if self.is_driver
                   else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(problem, src=0)
        if problem[0] is None:
            return
        if not Path(self.base["path"]).is_absolute():  # the run's own (checkpoint/base_check.py)
            self.base = self._write_own_base()
            self._say(f"checkpoints: {problem[0]}: the base was written again from the run's frozen weights, into "
                      f"{self.root / Path(self.base['path']).name}; checkpoint {checkpoint_name(step)} and the later "
                      "ones refer to it (the earlier ones refer to the one that changed)")
            return
        raise TrainingStopped(
            f"step {step}: this run's checkpoints refer to their base model instead of holding it "
            f"(checkpoint.base_weights=referenced), and {problem[0]}. The run stops before writing checkpoint "
            f"{checkpoint_name(step)}, which no resume could load; the checkpoints so far are kept. Put the base "
            f"back at {self.base['path']} as it was, then run the same command to resume")

    def _load_initial_weights(self) -> None:
        source = self.config.checkpoint.init_from
        if source is None:
            return  # the random initialization (seeded) of the built-in default
        from megatron_rl.checkpoint.format import load_initial_weights

        load_initial_weights(self.policy, source)  # a HF model, a megatron-rl checkpoint or run directory

    def reference_weights(self):
        """The KL reference: the restored one on resume, else the policy as it is now (after the
        warm start), kept in every later checkpoint so a resumed run keeps the same reference."""
        from megatron_rl.model.reference import ReferenceWeights

        if self.reference is None:
            self.reference = ReferenceWeights.snapshot(self.policy.module)
        return self.reference

    @property
    def _uses_kl(self) -> bool:
        return recipe_for(self.config.rl, self.config.response_budget).loss.kl_coef > 0

    # ---- during the run -----------------------------------------------------------------------

    def after_step(self, step: int, trainer_state: dict, *, stop: bool, last: bool):
        """Checkpoint when due (every_steps, the last step, a stop signal). Returns the SaveStats
        of checkpoints published during this call (a background save finishing counts)."""
        published = self._poll(blocking=False)
        every = self.config.checkpoint.every_steps
        if stop or last or (every and step % every == 0):
            published += self._poll(blocking=True)  # one save in flight at a time
            self.pending = self._begin(step, trainer_state, async_save=self.config.checkpoint.async_save)
            if self.pending.process is None:
                # Written synchronously: begin_save published it already. Polling it again would
                # finalize Megatron's save a second time (its results queue is empty by then).
                published.append(self.pending.stats)
                self.pending = None
            elif stop or last:  # the process is about to exit: wait for the files
                published += self._poll(blocking=True)
        return published

    def _begin(self, step: int, trainer_state: dict, async_save: bool):
        from megatron_rl.checkpoint import store as ckpt

        self._keep_base(step)  # the checkpoint about to be written refers to it
        extra = {"reference": self.reference.tensors} if self.reference is not None else {}
        return ckpt.begin_save(self.root, step, self.policy, trainer_state, keep_last=self.config.checkpoint.keep_last,
                               keyed_like_weights=extra, metadata=self._metadata(), hf_files=self._model_files(),
                               async_save=async_save, device=self.runtime.device)

    def _poll(self, blocking: bool) -> list:
        pending = self.pending
        try:
            if pending is None or not pending.poll(blocking=blocking):
                return []
        except TrainingStopped:  # the save failed on some rank and was abandoned: nothing left to wait for
            self.pending = None
            raise
        stats, self.pending = self.pending.stats, None
        return [stats]

    def close(self, clean: bool) -> list:
        """Wait for a save in flight. `clean=False` (an error elsewhere): other ranks may not be
        here, so no collective: the unfinished save stays unpublished (removed at next start)."""
        if self.pending is None:
            return []
        if clean:
            return self._poll(blocking=True)
        if self.pending.process is not None:
            self.pending.process.join()
        self.pending = None
        return []

    # ---- describing the model -------------------------------------------------------------------

    def _metadata(self) -> dict:
        from megatron_rl.checkpoint.format import FORMAT

        p = self.config.parallel
        return {"format": FORMAT, "weights_dir": "weights", "padded_vocab_size": self.policy.module.vocab_size,
                "precision": self.config.model.precision, "source": str(self.out.resolve()),
                "saved_layout": {"tp": p.tp, "pp": p.pp, "ep": p.ep, "etp": p.expert_tp, "dp": self.runtime.dp_size,
                                 "distributed_optimizer": p.distributed_optimizer},
                **({"base": self.base} if self.base is not None else {})}

    def _model_files(self) -> dict[str, bytes]:
        if not self.is_driver:
            return {}
        return {path.name: path.read_bytes() for path in sorted(self.model_dir.iterdir()) if path.is_file()}

    # ---- the end ---------------------------------------------------------------------------------

    def export_hf(self, step: int, tokenizer, checkpoint: Path | None) -> Path:
        """Collective: the policy as a Hugging Face model in OUTPUT_DIR/hf_model, at the model's
        precision (whatever model.export_fp8 says for rollout), with a full generation config
        (the run's sampling settings, `tokenizer`'s special tokens) and a record of where it came
        from (`checkpoint`: the last one saved) and how prompts must be formatted."""
        import torch

        rl, data = self.config.rl, self.config.data
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        generation = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                      "pad_token_id": pad, "do_sample": rl.temperature > 0, "temperature": rl.temperature,
                      "top_p": rl.top_p, "max_new_tokens": rl.max_response_tokens}
        provenance = {
            "run": str(self.out.resolve()), "checkpoint": str(checkpoint) if checkpoint else None,
            "recipe": rl.recipe, "precision": self.config.model.precision,
            "prompt_format": data.prompt_format, "system_prompt": data.system_prompt,
            "prompt_format_help": ("the prompt text tokenized as it is, with the tokenizer's special tokens"
                                   if data.prompt_format == "raw" else
                                   "tokenizer.apply_chat_template(messages, add_generation_prompt=True), "
                                   "the system prompt first"),
            "eval_temperature": rl.eval_temperature,
        }

        from megatron_rl.checkpoint.atomic_dir import AtomicDirectory
        from megatron_rl.bridge.hf_checkpoint import write_hf_checkpoint

        target = self.out / HF_EXPORT
        dtype = torch.bfloat16 if self.config.model.precision == "bf16" else torch.float32
        with AtomicDirectory(target, force=True) as staging:
            write_hf_checkpoint(self.policy.module, self.policy.arch, self.policy.raw_hf_config, staging,
                                template_dir=self.model_dir, dtype=dtype, fp8=False)
            if self.is_driver:
                (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
                (staging / "megatron_rl_export.json").write_text(json.dumps(dict(provenance, step=step), indent=2) + "\n")
        return target

    def record_run_state(self, step: int, finished: bool) -> None:
        """OUTPUT_DIR/run_state.json: the last step done, and whether the run finished or was stopped."""
        if self.is_driver:
            (self.out / "run_state.json").write_text(json.dumps({"step": step, "finished": finished}))

    def _say(self, text: str) -> None:
        if self.is_driver:
            print(text, flush=True)


def _complete_candidates(root: Path) -> list[Path]:
    from megatron_rl.checkpoint import store as ckpt

    return [p for p in ckpt.candidates(root) if ckpt.verify(p, checksums=False) is None]
