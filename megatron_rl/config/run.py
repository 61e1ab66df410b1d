"""The root of the tree (RunConfig) and its small sections; the checks that cross sections.

Checks that need the world size (does the layout divide the number of ranks?) live in
`ParallelConfig.validate_world_size`, called by the runtime at start-up, and by the launcher
before a job is submitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.algorithms.from_config import overlong_lengths
from megatron_rl.config.model import ModelConfig, OptimizerConfig, ParallelConfig, check_learning_rate
from megatron_rl.config.rl import RLConfig
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.data.config import DataConfig
from megatron_rl.errors import ConfigError
from megatron_rl.rewards.config import RewardConfig

Device = Literal["auto", "cpu", "cuda"]


@dataclass
class WarmStartConfig:
    """Supervised warm start before RL (the built-in default learns its task format this way):
    next-token loss on the targets of the training prompts."""

    steps: int = 250  # 0 = none (the default is the built-in tiny run's)
    batch_size: int = 64
    lr: float = 3e-3

    def validate(self, where: str) -> None:
        if self.steps < 0 or self.batch_size < 1:
            raise ConfigError(f"{where}: steps must be >= 0 and batch_size >= 1")
        if self.batch_size > 1 << 16:  # its sequences are packed and trained on together
            raise ConfigError(f"{where}.batch_size must be at most {1 << 16} (sequences trained on at once), "
                              f"got {self.batch_size}")
        check_learning_rate(f"{where}.lr", self.lr)


@dataclass
class CheckpointConfig:
    every_steps: int = 10  # 0: only on SIGTERM/SIGUSR1 and at the end
    keep_last: int = 2
    # "auto": continue from the newest intact checkpoint in OUTPUT_DIR/checkpoints, if there is
    # one (refused when checkpoints exist but none is intact); "none": start over (an earlier run's
    # checkpoints and metrics are moved into OUTPUT_DIR/previous-<time>/); or a checkpoint path.
    resume: str = "auto"
    # Initial weights: None (random init, for the built-in default), a Hugging Face model
    # directory, a directory written by `megatron-rl convert hf-to-megatron` or `megatron-rl sft`,
    # or a training checkpoint (a step_* directory, or a run directory meaning its latest).
    init_from: str | None = None
    # Write checkpoints in the background (a forked writer per rank) while training continues.
    async_save: bool = True
    # At the end of the run, export the policy as a Hugging Face model into OUTPUT_DIR/hf_model.
    export_hf: bool = True
    # Under model.lora: "referenced" checkpoints hold the adapters, their optimizer state and the
    # run state, and name the frozen base (checkpoint.init_from, or checkpoints/base/ written once
    # for a run from random initialization) with every file's size and CRC-32: a resume refuses a
    # base that changed. "saved": every checkpoint holds the base too (self-contained).
    base_weights: Literal["referenced", "saved"] = "referenced"
    # Resuming a checkpoint written with another config is refused (naming the keys) unless true;
    # the layout, logging and checkpoint keys may always differ. An accepted change takes effect
    # from the resumed step (optimizer settings included); warm_start.* and seed, which a resume
    # cannot apply, are refused by name even then.
    allow_config_change: bool = False

    def validate(self, where: str) -> None:
        if self.every_steps < 0 or self.keep_last < 1:
            raise ConfigError(f"{where}: every_steps must be >= 0 and keep_last >= 1")


@dataclass
class LoggingConfig:
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "megatron-rl"
    run_name: str | None = None


@dataclass
class RunConfig:
    """The root of the tree."""

    seed: int = 1234
    device: Device = "auto"
    output_dir: str = "runs/default"
    # Tokens per packed micro-batch when computing logprobs or training.
    micro_batch_tokens: int = 4096
    # Chunk of tokens for the vocab-parallel logprob/entropy kernel (bounds fp32 memory).
    logprob_chunk_tokens: int = 1024
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rewards: RewardConfig = field(default_factory=RewardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self, where: str = "config") -> RunConfig:
        if self.micro_batch_tokens < 1:
            raise ConfigError(f"{where}: micro_batch_tokens must be >= 1")
        if self.logprob_chunk_tokens < 1:
            raise ConfigError(f"{where}: logprob_chunk_tokens must be >= 1")
        self.model.validate(f"{where}: model")
        self.parallel.validate(f"{where}: parallel")
        self.optimizer.validate(f"{where}: optimizer")
        self.rollout.validate(f"{where}: rollout")
        self.rl.validate(f"{where}: rl")
        if self.rl.overlong_max_length is not None or self.rl.overlong_buffer_length is not None:
            # lengths given: do they ever apply to this run's trajectories? (DAPO's ratio, as dapo's)
            overlong_lengths(self.rl, None, None, f"{where}: rl", budget=self.response_budget)
        if self.rl.routing_replay == "rollout":
            if self.rollout.engine != "vllm":
                raise ConfigError(f"{where}: rl.routing_replay=rollout needs the rollout engine's routes, which only "
                                  f"the vLLM engines return here (rollout.engine={self.rollout.engine}); use "
                                  "rl.routing_replay=training")
            if self.parallel.cp > 1:
                raise ConfigError(f"{where}: rl.routing_replay=rollout maps the engine's routes onto whole packed "
                                  f"sequences and does not support context parallelism (parallel.cp={self.parallel.cp})")
        self._validate_async(where)
        self._validate_lora_push(where)
        self.warm_start.validate(f"{where}: warm_start")
        self._validate_weight_decay(where)
        self.data.validate(f"{where}: data")
        self.rewards.validate(f"{where}: rewards")
        self.checkpoint.validate(f"{where}: checkpoint")
        self._validate_fp8_rollout(where)
        # The recipe overrides are checked by trainer.preflight (building a Recipe imports torch).
        return self

    @property
    def response_budget(self) -> int:
        """The most model (sampled) tokens one trajectory holds: rl.max_response_tokens in a
        single-turn run; in a multi-turn run its model turns together, rollout.max_turns of
        rl.max_response_tokens, at most rollout.max_total_tokens (observations share that budget)
        or rollout.max_model_len. Overlong shaping and Dr. GRPO's L_norm measure against it."""
        per_turn = self.rl.max_response_tokens
        if not self.rollout.multi_turn:
            return per_turn
        total = self.rollout.max_total_tokens if self.rollout.max_total_tokens is not None else self.rollout.max_model_len
        return min(self.rollout.max_turns * per_turn, total)

    def _validate_weight_decay(self, where: str) -> None:
        """Adam's decoupled weight decay (AdamW, what Megatron-Core runs) multiplies every weight by
        1 - lr x weight_decay at each update: from lr x weight_decay = 1 on that flips the weights'
        sign, and beyond 2 grows them geometrically (optimizer.lr=1 optimizer.weight_decay=1e4: x -29
        per warm-start update, finite weights of 8.5e14 checkpointed). Both rates it runs at: RL's
        and, when there is one, the warm start's."""
        decay = self.optimizer.weight_decay
        rates = [("optimizer.lr", self.optimizer.lr)] + ([("warm_start.lr", self.warm_start.lr)]
                                                          if self.warm_start.steps else [])
        bad = [f"with {key}={lr:g} every weight is multiplied by 1 - lr x weight_decay = {1 - lr * decay:.4g} "
               "at each update" for key, lr in rates if lr * decay >= 1]
        if bad:
            raise ConfigError(f"{where}: optimizer.weight_decay={decay:g} is too large for the learning rate: "
                              f"{'; '.join(bad)}. From lr x weight_decay = 1 on, that flips the weights' sign at "
                              "every update, and from 2 on makes them grow without bound. Keep lr x weight_decay "
                              "below 1 (a weight_decay like 0.01 .. 0.1 is usual)")

    def _validate_async(self, where: str) -> None:
        """Asynchronous RL needs engines that generate while the trainer trains: servers."""
        staleness = self.rl.max_staleness
        if staleness and self.rollout.mode != "server":
            raise ConfigError(
                f"{where}: rl.max_staleness={staleness} overlaps generation with training, which needs "
                f"engines running beside the trainer (rollout.mode: server); a colocated engine shares the "
                f"trainer's processes and devices, so nothing would overlap. Use rollout.mode=server or "
                f"rl.max_staleness=0")
        if self.rollout.partial and not staleness:
            raise ConfigError(f"{where}: rollout.partial=true continues sequences across weight updates, which only "
                              f"happen mid-generation with rl.max_staleness >= 1")
        if self.rollout.partial and self.rl.routing_replay == "rollout":
            raise ConfigError(f"{where}: rollout.partial=true with rl.routing_replay=rollout: a continued sequence's "
                              f"routes would come from two weight versions; use one or the other")

    def _validate_lora_push(self, where: str) -> None:
        """rollout.lora_push=adapters (vLLM's own LoRA); what needs the model's architecture (the
        targets, the family) is checked by preflight (rollout/engines/vllm_lora.py)."""
        if self.rollout.lora_push != "adapters":
            return
        key = f"{where}: rollout.lora_push=adapters"
        if self.model.lora is None:
            raise ConfigError(f"{key} pushes LoRA adapters, but model.lora is not set (a full fine-tuning run has "
                              "none); leave rollout.lora_push at merged")
        if self.rollout.engine != "vllm":
            raise ConfigError(f"{key} needs vLLM's native LoRA (enable_lora); rollout.engine={self.rollout.engine} "
                              "gets the merged weights (rollout.lora_push=merged)")
        if self.rollout.mode != "colocated":
            raise ConfigError(f"{key} is built for the colocated vLLM engine only; a vLLM server (rollout.mode="
                              f"{self.rollout.mode}) gets the merged weights (rollout.lora_push=merged)")
        if self.model.export_fp8:
            raise ConfigError(f"{key} with model.export_fp8=true: LoRA over FP8 base weights in vLLM is not "
                              "verified here; use rollout.lora_push=merged")
        if self.rl.routing_replay == "rollout":
            raise ConfigError(f"{key} with rl.routing_replay=rollout: the routes recorded by an engine that "
                              "serves its adapters through vLLM's LoRA layers are not verified here; use "
                              "rollout.lora_push=merged")

    def _validate_fp8_rollout(self, where: str) -> None:
        """model.export_fp8 on any machine (the engine's device is checked by preflight)."""
        if not self.model.export_fp8:
            return
        dtype = self.rollout.dtype
        if dtype == "auto":
            dtype = "bfloat16" if self.model.precision == "bf16" else "float32"
        if dtype != "bfloat16":
            # vLLM's and SGLang's fp8 methods accept bfloat16/float16 activations only (vLLM
            # refuses float32 at engine start, after the model was built).
            raise ConfigError(
                f"{where}: model.export_fp8=true needs a bfloat16 rollout engine (FP8 weights run with BF16 "
                f"activations), but the engine dtype is {dtype}: set rollout.dtype: bfloat16 or model.precision: bf16"
            )
