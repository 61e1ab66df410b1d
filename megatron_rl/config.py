"""One typed configuration tree for a run.

Every setting a run uses lives here, in nested dataclasses, loaded from a YAML recipe plus
command-line overrides (`section.key=value`). Loading validates everything that can be checked
without starting processes: unknown keys (with a suggestion), wrong types, out-of-range values and
parallel layouts Megatron-Core trains wrongly. Errors name the file and the dotted key, so a bad
recipe fails in milliseconds instead of after model construction.

Checks that need the world size (does the layout divide the number of ranks?) live in
`ParallelConfig.validate_world_size`, called by the platform layer at start-up, and by the launcher
before a job is submitted.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A configuration value is missing, unknown or inconsistent; the message says which and why."""


Precision = Literal["fp32", "bf16"]
Fp8Recipe = Literal["delayed", "current", "blockwise", "mxfp8"]
Device = Literal["auto", "cpu", "cuda"]
Dispatcher = Literal["alltoall", "allgather"]


@dataclass
class ModelConfig:
    # A Hugging Face config.json (file or directory holding one), or the name of a preset shipped
    # with the package (see megatron_rl/model/presets/).
    hf_config: str = "tiny-qwen3-moe"
    precision: Precision = "fp32"
    # FP8 training through Transformer Engine (needs precision: bf16 and a CUDA GPU; checked
    # against the GPU and the TE version before the model is built, see model/fp8.py):
    #   delayed    per-tensor scales from an amax history (compute capability 8.9+)
    #   current    per-tensor scales from the current tensor (Megatron: "tensorwise"; 8.9+)
    #   blockwise  1x128 activation and 128x128 weight tiles, DeepSeek-V3 style (9.0+)
    #   mxfp8      32-element blocks with power-of-two scales (Blackwell, 10.x)
    fp8_recipe: Fp8Recipe | None = None
    # Keep the GEMM weights themselves in FP8 and all-gather them in FP8 (saves memory; the
    # distributed optimizer keeps the fp32 master copy, so it requires parallel.distributed_optimizer).
    fp8_param: bool = False
    # Transformer layers kept in BF16 at the start / end of the model while the rest runs in FP8
    # (the first and last layers are the most sensitive to quantization). Megatron-Core supports
    # this with every recipe except delayed scaling.
    fp8_bf16_first_layers: int = 0
    fp8_bf16_last_layers: int = 0
    # Grouped-GEMM experts (TE's GroupedLinear: all local experts in one kernel). None = on with
    # the Transformer Engine layer spec, off with the local spec (which cannot run it).
    moe_grouped_gemm: bool | None = None
    # Hand the rollout engine (and HF checkpoint exports) FP8 weights: every linear weight as
    # float8_e4m3fn with one scale per 128x128 block, in the HF FP8 checkpoint format
    # (DeepSeek-V3, Qwen3-FP8). Independent of fp8_recipe: a BF16-trained policy can export FP8.
    export_fp8: bool = False
    # Megatron pads the embedding rows to a multiple of this times TP; the padding never enters
    # the softmax of our logprobs (it is masked), and the bridge trims it on export.
    make_vocab_size_divisible_by: int = 128
    # Embedding rows including padding. None = Megatron's rule above. Checkpoints record theirs
    # and loading reuses it, so a checkpoint saved at one TP size loads at another.
    padded_vocab_size: int | None = None
    moe_token_dispatcher: Dispatcher = "alltoall"
    # RL on verifiable rewards usually trains without the load-balancing loss; set > 0 to add it.
    moe_aux_loss_coeff: float = 0.0
    # "auto": Transformer Engine layers when TE and CUDA are present, local layers otherwise.
    layer_spec: Literal["auto", "local", "transformer_engine"] = "auto"

    @property
    def fp8_bf16_layers(self) -> bool:
        return self.fp8_bf16_first_layers > 0 or self.fp8_bf16_last_layers > 0

    def validate(self, where: str) -> None:
        if self.make_vocab_size_divisible_by < 1:
            raise ConfigError(f"{where}.make_vocab_size_divisible_by must be >= 1")
        if self.padded_vocab_size is not None and self.padded_vocab_size < 1:
            raise ConfigError(f"{where}.padded_vocab_size must be >= 1")
        if self.moe_aux_loss_coeff < 0:
            raise ConfigError(f"{where}.moe_aux_loss_coeff must be >= 0")
        self._validate_fp8(where)

    def _validate_fp8(self, where: str) -> None:
        """FP8 settings that are wrong on any machine (the GPU and TE checks come at build time)."""
        recipe = self.fp8_recipe
        if recipe is not None and self.precision != "bf16":
            # TE's FP8 GEMMs take BF16 inputs and Megatron keeps fp32 master weights only for
            # bf16/fp16 params; an fp32 model would quantize from fp32 activations nobody tested.
            raise ConfigError(f"{where}.fp8_recipe={recipe!r} requires precision: bf16 (got {self.precision})")
        if self.fp8_param and recipe is None:
            raise ConfigError(f"{where}.fp8_param=true needs an FP8 recipe: set fp8_recipe as well")
        for key in ("fp8_bf16_first_layers", "fp8_bf16_last_layers"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{where}.{key} must be >= 0, got {getattr(self, key)}")
        if self.fp8_bf16_layers:
            if recipe is None:
                raise ConfigError(
                    f"{where}.fp8_bf16_first_layers/fp8_bf16_last_layers only apply with fp8_recipe set"
                )
            if recipe == "delayed":
                # Megatron-Core refuses it: leaving and re-entering the FP8 autocast per layer
                # breaks delayed scaling's amax reduction.
                raise ConfigError(
                    f"{where}.fp8_recipe=delayed cannot keep layers in BF16 (fp8_bf16_first_layers/"
                    "fp8_bf16_last_layers); use fp8_recipe: current or blockwise, or set both to 0"
                )


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline parallel
    ep: int = 1  # expert parallel
    etp: int | None = None  # expert tensor parallel; None means "same as tp"
    cp: int = 1  # context parallel
    # None = on whenever tp > 1 (Megatron requires it for MoE with TP, and it saves activations).
    sequence_parallel: bool | None = None
    distributed_optimizer: bool = True

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def uses_sequence_parallel(self) -> bool:
        return self.tp > 1 if self.sequence_parallel is None else self.sequence_parallel

    def validate(self, where: str) -> None:
        for name in ("tp", "pp", "ep", "cp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}.{name} must be >= 1, got {getattr(self, name)}")
        if self.etp is not None and self.etp < 1:
            raise ConfigError(f"{where}.etp must be >= 1 (or null for 'same as tp'), got {self.etp}")
        if self.sequence_parallel is False and self.tp > 1:
            # Megatron-Core's MoE layers refuse TP without sequence parallelism, and for dense
            # models it only costs memory; keep one supported path.
            raise ConfigError(
                f"{where}.sequence_parallel=false with tp={self.tp} is not supported: "
                "leave it unset (on when tp > 1)"
            )

    def validate_for_model(self, where: str, *, num_experts: int | None) -> None:
        """Layout checks that depend on the model (MoE or dense)."""
        if num_experts:
            if self.tp > 1 and self.ep == 1 and self.expert_tp == 1:
                # Measured: the expert weights are then replicated across the TP group but their
                # gradients are never reduced over it, so TP ranks drift apart.
                raise ConfigError(
                    f"{where}: tp={self.tp} with ep=1 and etp=1 trains MoE experts wrongly "
                    "(expert gradients are not reduced across the tensor-parallel group). "
                    f"Use etp={self.tp} (expert tensor parallel) or ep>1."
                )
            if num_experts % self.ep:
                raise ConfigError(
                    f"{where}.ep={self.ep} must divide the number of experts ({num_experts})"
                )
        elif self.ep > 1 or (self.etp is not None and self.etp != self.tp):
            raise ConfigError(f"{where}: ep/etp are only meaningful for MoE models (this one is dense)")

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp * self.cp)

    def validate_world_size(self, world_size: int, where: str = "parallel") -> None:
        dense_block = self.tp * self.pp * self.cp
        if world_size % dense_block:
            raise ConfigError(
                f"{where}: world size {world_size} is not divisible by tp*pp*cp = "
                f"{self.tp}*{self.pp}*{self.cp} = {dense_block}"
            )
        expert_block = self.expert_tp * self.ep * self.pp
        if world_size % expert_block:
            raise ConfigError(
                f"{where}: world size {world_size} is not divisible by etp*ep*pp = "
                f"{self.expert_tp}*{self.ep}*{self.pp} = {expert_block}"
            )


@dataclass
class OptimizerConfig:
    lr: float = 1e-5
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # Learning-rate schedule over optimizer steps: linear warm-up, then constant or a decay to
    # min_lr over lr_decay_steps (None = the run's total optimizer steps).
    lr_warmup_steps: int = 0
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    lr_decay_steps: int | None = None

    def validate(self, where: str) -> None:
        if self.lr <= 0:
            raise ConfigError(f"{where}.lr must be > 0, got {self.lr}")
        if self.lr_warmup_steps < 0:
            raise ConfigError(f"{where}.lr_warmup_steps must be >= 0")
        if self.lr_decay_steps is not None and self.lr_decay_steps <= self.lr_warmup_steps:
            raise ConfigError(f"{where}.lr_decay_steps must be > lr_warmup_steps ({self.lr_warmup_steps})")
        if self.min_lr > self.lr:
            raise ConfigError(f"{where}.min_lr ({self.min_lr}) must be <= lr ({self.lr})")
        if not 0 <= self.adam_beta1 < 1 or not 0 <= self.adam_beta2 < 1:
            raise ConfigError(f"{where}.adam_beta1/adam_beta2 must be in [0, 1)")
        if self.clip_grad < 0:
            raise ConfigError(f"{where}.clip_grad must be >= 0 (0 disables clipping)")


@dataclass
class RolloutConfig:
    """The rollout engine: where it runs, how weights reach it, and how requests are bounded."""

    engine: Literal["vllm", "sglang"] = "vllm"
    # colocated: an engine inside the trainer processes, its tensor parallelism spanning the
    # trainer's ranks (vLLM only; the default on CPU). server: OpenAI-compatible HTTP servers,
    # started by us on this node (server_urls empty) or already running elsewhere.
    mode: Literal["colocated", "server"] = "colocated"
    server_urls: list[str] = field(default_factory=list)
    num_servers: int = 1  # servers to start when server_urls is empty
    # Engine dtype; "auto" follows model.precision (fp32 -> float32, bf16 -> bfloat16).
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    max_model_len: int = 1024
    gpu_memory_utilization: float = 0.5
    cpu_kv_cache_gib: float = 1.0
    # How weights travel after each step. auto: same-process stream when colocated, NCCL broadcast
    # to servers on GPU, safetensors files on a shared filesystem to servers on CPU.
    weight_transport: Literal["auto", "stream", "files", "nccl"] = "auto"
    weight_bucket_mb: int = 512
    # Where the files transport stages buckets; must be visible to the servers. None = OUTPUT_DIR/.weights
    staging_dir: str | None = None
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 900.0
    max_retries: int = 2  # per request, for transient HTTP failures; then the engine is reported dead

    def validate(self, where: str) -> None:
        if self.engine == "sglang" and self.mode == "colocated":
            raise ConfigError(f"{where}.mode=colocated is vLLM only; SGLang runs as servers (mode: server)")
        if self.weight_transport == "stream" and self.mode == "server":
            raise ConfigError(f"{where}.weight_transport=stream needs mode=colocated; servers take files or nccl")
        if self.weight_transport in ("files", "nccl") and self.mode == "colocated":
            raise ConfigError(f"{where}.weight_transport={self.weight_transport} is for servers; colocated engines use stream")
        for name in ("num_servers", "max_model_len", "weight_bucket_mb"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_retries < 0:
            raise ConfigError(f"{where}.max_retries must be >= 0")
        for name in ("startup_timeout_s", "request_timeout_s", "cpu_kv_cache_gib"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{where}.{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"{where}.gpu_memory_utilization must be in (0, 1]")
        for url in self.server_urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"{where}.server_urls: {url!r} must start with http:// or https://")


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

    def validate(self, where: str = "config") -> RunConfig:
        if self.micro_batch_tokens < 1:
            raise ConfigError(f"{where}: micro_batch_tokens must be >= 1")
        if self.logprob_chunk_tokens < 1:
            raise ConfigError(f"{where}: logprob_chunk_tokens must be >= 1")
        self.model.validate(f"{where}: model")
        self.parallel.validate(f"{where}: parallel")
        self.optimizer.validate(f"{where}: optimizer")
        self.rollout.validate(f"{where}: rollout")
        return self


# ---------------------------------------------------------------------------------------------
# Loading: YAML + dotted overrides -> dataclasses, with errors that name the file and the key.
# ---------------------------------------------------------------------------------------------


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Build a validated RunConfig from an optional YAML file and `a.b=value` overrides."""
    raw: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping, got {type(loaded).__name__}")
        raw = loaded
    for item in overrides or []:
        _apply_override(raw, item)
    config = _build(RunConfig, raw, source=source, prefix="")
    return config.validate(source)


def _apply_override(raw: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    dotted, text = item.split("=", 1)
    keys = dotted.strip().split(".")
    node = raw
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {key} is not a section")
    node[keys[-1]] = yaml.safe_load(text) if text.strip() else None


def _build(cls: type, raw: Any, source: str, prefix: str) -> Any:
    where = f"{source}: {prefix.rstrip('.') or 'top level'}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping for {cls.__name__}, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in raw if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), list(fields), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(fields)}"
        raise ConfigError(f"{source}: unknown key '{prefix}{key}'{hint}")
    values = {}
    for name, value in raw.items():
        values[name] = _coerce(hints[name], value, source, f"{prefix}{name}")
    return cls(**values)


def _coerce(hint: Any, value: Any, source: str, key: str) -> Any:
    where = f"{source}: {key}"
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value if value is not None else {}, source, f"{key}.")
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(option, value, source, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} fits none of {hint}")
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, allowed))}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):
            # YAML 1.1 reads exponents without a dot (3e-6) as strings; accept them as numbers.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(item, element, source, f"{key}[{index}]") for index, element in enumerate(value)]
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported config type {hint}")  # a bug in this module, not input


def to_dict(config: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)
