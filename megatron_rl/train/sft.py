"""`megatron-rl sft`: the supervised warm start as a command of its own, writing a checkpoint.

    megatron-rl sft [--config FILE] [--output-dir DIR] [--force] [key=value ...]

The same config tree, runtime and layouts as `train` (several ranks under torchrun, any layout the
policy supports). It builds the policy (random init, or `checkpoint.init_from`), runs
`warm_start.steps` supervised steps of `warm_start.batch_size` training prompts of the `data`
section at the fixed rate `warm_start.lr`, on each prompt's reference response
(`metadata["target"]`, else the answer), with the very function `train` runs for its in-train
warm start (megatron_rl/train/warm_start.py), and writes DIR (default OUTPUT_DIR/sft):

    *.distcp, .metadata, metadata.json, common.pt   the weights, Megatron torch_dist (any layout)
    hf_config/                                      config.json and the tokenizer files
    megatron_rl.json                                format, padded vocabulary, precision, layout, sft settings
    metrics.jsonl                                   a row per step: sft/loss, sft/grad_norm, sft/lr, time, elapsed_s

That is megatron_rl.tools.convert's checkpoint format (the same writer), so

    megatron-rl train checkpoint.init_from=DIR warm_start.steps=0    # RL from the sft weights
    megatron-rl convert megatron-to-hf --ckpt DIR --out HF_DIR        # a transformers model + tokenizer

Weights only: RL started from DIR begins with a fresh optimizer (the in-train warm start hands
its Adam moments on to RL), so its start weights equal those of an in-train warm start of the
same settings, while its RL updates are not bit-identical to that run's.
Bad settings (warm_start.steps < 1, missing data, prompts without a reference response, an
existing DIR without --force, a layout that does not fit) are refused before any model is built.
A DIR that is, contains or lies inside an input (checkpoint.init_from, the data, model.hf_config)
is refused with or without --force, and --force replaces only an earlier `megatron-rl sft` output
(checkpoint/output_guard.py): never a training run or anything else that happens to be there.
The output appears atomically: a failed run leaves no DIR.
"""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.checkpoint.output_guard import refuse_existing, refuse_overlap
from megatron_rl.config import RunConfig
from megatron_rl.errors import ConfigError

OWNER = "megatron-rl sft"  # the marker its outputs carry: what its --force may replace


@dataclass
class SftResult:
    output: Path
    losses: list[float]
    is_driver: bool  # global rank 0: the rank that prints


def default_output(config: RunConfig) -> Path:
    return Path(config.output_dir) / "sft"


def preflight(config: RunConfig, output: Path, force: bool = False):
    """Everything checkable before the model is built; returns the training prompts."""
    from megatron_rl.data import load_datasets
    from megatron_rl.train.preflight import check_layout_and_paths
    from megatron_rl.train.warm_start import check_targets

    steps = config.warm_start.steps
    if steps < 1:
        raise ConfigError(f"warm_start.steps must be >= 1 for megatron-rl sft, got {steps}")
    inputs, inside_ok = _inputs(config)
    refuse_overlap(output, inputs, inside_ok=inside_ok)
    refuse_existing(output, force, OWNER)
    check_layout_and_paths(config, rl=False)
    if config.data.train != "synthetic" and not Path(config.data.train).exists():
        raise ConfigError(f"data.train: {config.data.train} does not exist")
    train_set, _ = load_datasets(config.data)
    check_targets(train_set)
    return train_set


def _inputs(config: RunConfig) -> tuple[dict[str, str | Path | None], tuple[str, ...]]:
    """What sft reads that a path names ({key: path}), and the keys the output may lie inside: a run
    directory given as checkpoint.init_from stands for its newest checkpoint, also an input."""
    from megatron_rl.checkpoint.format import names_megatron_checkpoint, resolve_checkpoint

    init_from = config.checkpoint.init_from
    train = None if config.data.train == "synthetic" else config.data.train  # the built-in task, not a path
    inputs = {"checkpoint.init_from": init_from, "data.train": train, "data.heldout": config.data.heldout,
              "model.hf_config": config.model.hf_config}
    if init_from and names_megatron_checkpoint(init_from):
        inputs["the checkpoint checkpoint.init_from names"] = resolve_checkpoint(init_from)
        if Path(inputs["the checkpoint checkpoint.init_from names"]).resolve() != Path(init_from).resolve():
            return inputs, ("checkpoint.init_from",)
    return inputs, ()


def run_sft(config: RunConfig, output: str | Path | None = None, force: bool = False) -> SftResult:
    output = Path(output) if output is not None else default_output(config)
    train_set = preflight(config, output, force)

    from transformers import AutoTokenizer

    from megatron_rl.checkpoint.atomic_dir import AtomicDirectory
    from megatron_rl.checkpoint.format import load_initial_weights, pin_checkpoint_vocab, save_megatron_checkpoint
    from megatron_rl.checkpoint.format import write_run_tokenizer
    from megatron_rl.model.policy import Policy
    from megatron_rl.runtime import start_runtime
    from megatron_rl.train.warm_start import warm_start

    settings = config.warm_start
    # Every rank writes and reads its own copy (no shared filesystem needed); it goes into the
    # checkpoint's hf_config/ at the end.
    with tempfile.TemporaryDirectory(prefix="megatron-rl-sft-tokenizer-") as tokenizer_dir:
        write_run_tokenizer(config, tokenizer_dir)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        if tokenizer.eos_token_id is None:
            raise ConfigError("the tokenizer has no EOS token; supervised responses could never stop")
        runtime = start_runtime(config)
        try:
            console = _Console(runtime.is_driver)
            policy = Policy(pin_checkpoint_vocab(config), runtime, total_steps=settings.steps)
            source = f"random init (seed {config.seed})"
            if config.checkpoint.init_from:
                load_initial_weights(policy, config.checkpoint.init_from)
                source = str(Path(config.checkpoint.init_from).resolve())
            p = config.parallel
            console.message(f"sft: {policy.arch.architecture} from {source}, tp={p.tp} pp={p.pp} ep={p.ep} "
                            f"dp={runtime.dp_size}; {settings.steps} steps of {settings.batch_size} prompts at "
                            f"lr {settings.lr:g} on {train_set.source} ({len(train_set)} prompts)")
            rows, started = [], time.monotonic()

            def on_step(step, result):
                rows.append({"step": step, "sft/grad_norm": result.grad_norm, "sft/loss": result.loss,
                             "sft/lr": settings.lr, "time": time.time(), "elapsed_s": time.monotonic() - started})

            losses = warm_start(policy, tokenizer, train_set, config, runtime, console, on_step=on_step, label="sft")
            extra = {"sft": {"steps": settings.steps, "batch_size": settings.batch_size, "lr": settings.lr,
                             "data": train_set.source, "first_loss": losses[0], "final_loss": losses[-1]}}
            with AtomicDirectory(output, force=force, owner=OWNER) as staging:
                save_megatron_checkpoint(policy.module, policy.raw_hf_config, staging, config,
                                         tokenizer_dir=tokenizer_dir, source=source, extra=extra)
                if runtime.is_driver:
                    (staging / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        finally:
            runtime.shutdown()
    return SftResult(output, losses, runtime.is_driver)


def next_commands(result: SftResult, config_file: str | None, overrides: list[str]) -> list[str]:
    """What to run next: RL from the checkpoint (with the same settings apart from the warm start
    and the output), and the conversion to a Hugging Face model directory."""
    skip = ("warm_start.", "checkpoint.init_from=", "output_dir=")
    carried = [o for o in overrides if not o.startswith(skip)]
    train = ["megatron-rl", "train", *(["--config", config_file] if config_file else []),
             f"checkpoint.init_from={result.output}", "warm_start.steps=0", *carried]
    convert = ["megatron-rl", "convert", "megatron-to-hf", "--ckpt", str(result.output),
               "--out", f"{result.output}-hf"]
    return [shlex.join(train), shlex.join(convert)]


class _Console:
    """The `log` warm_start prints its progress lines to: global rank 0's stdout."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def message(self, text: str) -> None:
        if self.enabled:
            print(text, file=sys.stdout, flush=True)
