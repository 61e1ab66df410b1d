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

from megatron_rl.data.config import DataConfig
from megatron_rl.rewards.config import RewardConfig

from megatron_rl.errors import ConfigError  # noqa: E402  (re-exported: the historical import path)


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
    # The rollout engines serve FP8 weights: weight sync hands them every linear weight as
    # float8_e4m3fn with one scale per 128x128 block (the HF FP8 checkpoint format of DeepSeek-V3
    # and Qwen3-FP8; bridge/fp8_export.py), the engine's config.json says so, and embeddings,
    # lm_head, norms and routers stay at the engine dtype. Needs a bfloat16 engine (FP8 GEMMs take
    # BF16 activations) on GPU: vLLM's CPU build is refused (preflight). Independent of
    # fp8_recipe: a BF16-trained policy can serve FP8. Checkpoints and the final hf_model export
    # stay at the training precision. Engines at rollout.server_urls must have been started from
    # a config.json carrying the matching quantization_config (bridge.with_quantization_config).
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
    # Aux-loss-free load balancing (DeepSeek-V3, GLM-4.5: models whose router carries
    # e_score_correction_bias). After every optimizer step each router's bias moves by this rate
    # toward even expert loads (Megatron-Core's expert-bias update; 1e-3 in DeepSeek-V3's
    # pre-training). 0 keeps the checkpoint's bias fixed, the usual choice for RL fine-tuning.
    # The bias is saved in checkpoints, exported and pushed to rollout engines as
    # e_score_correction_bias, and frozen in the KL reference.
    moe_router_bias_update_rate: float = 0.0
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
        if self.moe_router_bias_update_rate < 0:
            raise ConfigError(f"{where}.moe_router_bias_update_rate must be >= 0, got {self.moe_router_bias_update_rate}")
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
    # Uneven pipeline stages (pp > 1): layers on the first / last stage; the other stages split
    # the rest evenly. For layer counts pp does not divide (DeepSeek-V3's 61), and to give the
    # stages holding the embedding and the output layer fewer transformer layers.
    pp_first_stage_layers: int | None = None
    pp_last_stage_layers: int | None = None

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
        for name in ("pp_first_stage_layers", "pp_last_stage_layers"):
            value = getattr(self, name)
            if value is not None and (value < 1 or self.pp == 1):
                raise ConfigError(f"{where}.{name}={value} needs pp > 1 and a value >= 1 (leave it null otherwise)")
        if self.pp == 2 and self.pp_first_stage_layers is not None and self.pp_last_stage_layers is not None:
            raise ConfigError(f"{where}: with pp=2 set pp_first_stage_layers or pp_last_stage_layers, not both")
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
    # Defaults are the built-in tiny run's; the recipes in configs/ set their own.
    lr: float = 5e-4
    # Floor of the decay; None = lr / 10.
    min_lr: float | None = None
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # Learning-rate schedule over optimizer steps: linear warm-up, then constant or a decay to
    # min_lr over lr_decay_steps (None = the run's total optimizer steps).
    lr_warmup_steps: int = 0
    lr_decay_style: Literal["constant", "linear", "cosine"] = "cosine"
    lr_decay_steps: int | None = None

    def validate(self, where: str) -> None:
        if self.lr <= 0:
            raise ConfigError(f"{where}.lr must be > 0, got {self.lr}")
        if self.lr_warmup_steps < 0:
            raise ConfigError(f"{where}.lr_warmup_steps must be >= 0")
        if self.lr_decay_steps is not None and self.lr_decay_steps <= self.lr_warmup_steps:
            raise ConfigError(f"{where}.lr_decay_steps must be > lr_warmup_steps ({self.lr_warmup_steps})")
        if self.min_lr is not None and not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"{where}.min_lr ({self.min_lr}) must be in [0, lr={self.lr}]")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{where}.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.adam_eps <= 0:
            raise ConfigError(f"{where}.adam_eps must be > 0, got {self.adam_eps}")
        if self.weight_decay < 0:
            raise ConfigError(f"{where}.weight_decay must be >= 0, got {self.weight_decay}")
        if self.clip_grad < 0:
            raise ConfigError(f"{where}.clip_grad must be >= 0 (0 disables clipping), got {self.clip_grad}")

    @property
    def effective_min_lr(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr


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
    # Tensor parallel size of each server we start: one value for all, or one per server (servers
    # at server_urls report their own size to the collective transport).
    server_tp: int | list[int] = 1
    # Engine dtype; "auto" follows model.precision (fp32 -> float32, bf16 -> bfloat16).
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    max_model_len: int = 1024
    gpu_memory_utilization: float = 0.5
    cpu_kv_cache_gib: float = 1.0
    # How weights travel after each step (rollout/transport.py). stream: by reference into a
    # colocated engine. files: safetensors on a filesystem the servers share. collective: a
    # broadcast from each pipeline stage's leader to every rank of every server (vLLM), gloo on
    # CPU and NCCL on GPU; nccl: the same, requiring NCCL. auto: stream when colocated, collective
    # to vLLM servers, files to SGLang servers.
    weight_transport: Literal["auto", "stream", "files", "collective", "nccl"] = "auto"
    weight_bucket_mb: int = 512
    # Where the files transport stages buckets; must be visible to the servers. None = OUTPUT_DIR/.weights
    staging_dir: str | None = None
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 900.0
    max_retries: int = 2  # per request, for transient HTTP failures; then the engine is reported dead
    # Asynchronous RL (rl.max_staleness >= 1, servers only; megatron_rl/async_rollout.py).
    # partial: a weight update lands mid-generation: the engines abort their in-flight requests,
    # take the new weights, and every unfinished sequence continues from its last token on the
    # new weights (re-prefilled: no KV computed by the old weights is reused); its tokens record
    # which policy version produced them. false: an update waits until the engines are idle.
    partial: bool = False
    # Active sampling with dynamic sampling: groups are generated ahead of need so the engines
    # stay busy while zero-spread groups are dropped. At most this many groups beyond those still
    # needed are in flight; the unused ones are dropped when the step's batch is complete (the
    # bound on over-generation). None = a quarter of rl.prompts_per_step.
    overgeneration_groups: int | None = None

    def tp_of_server(self, index: int) -> int:
        """The tensor parallel size of the `index`-th server we start."""
        sizes = self.server_tp if isinstance(self.server_tp, list) else [self.server_tp]
        return sizes[index] if len(sizes) > 1 else sizes[0]

    def validate(self, where: str) -> None:
        if self.engine == "sglang" and self.mode == "colocated":
            raise ConfigError(f"{where}.mode=colocated is vLLM only; SGLang runs as servers (mode: server)")
        if self.weight_transport == "stream" and self.mode == "server":
            raise ConfigError(f"{where}.weight_transport=stream needs mode=colocated; servers take files or collective")
        if self.weight_transport in ("files", "collective", "nccl") and self.mode == "colocated":
            raise ConfigError(f"{where}.weight_transport={self.weight_transport} is for servers; colocated engines use stream")
        if self.weight_transport in ("collective", "nccl") and self.engine == "sglang":
            raise ConfigError(f"{where}.weight_transport={self.weight_transport}: SGLang servers take weights through "
                              f"files (weight_transport: files, with staging_dir on a filesystem they share)")
        sizes = self.server_tp if isinstance(self.server_tp, list) else [self.server_tp]
        if not sizes or any(size < 1 for size in sizes):
            raise ConfigError(f"{where}.server_tp must be >= 1 (one value, or one per server), got {self.server_tp}")
        if isinstance(self.server_tp, list) and len(sizes) not in (1, self.num_servers):
            raise ConfigError(f"{where}.server_tp lists {len(sizes)} sizes for num_servers={self.num_servers}; "
                              f"give one value for all servers or one per server")
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
        if self.overgeneration_groups is not None and self.overgeneration_groups < 0:
            raise ConfigError(f"{where}.overgeneration_groups must be >= 0 (or null), got {self.overgeneration_groups}")


RoutingReplay = Literal["off", "training", "rollout"]


def _routing_replay_value(value: Any) -> Any:
    """rl.routing_replay as written: true / false (the former boolean key, and YAML's reading of a
    bare `off`) mean training / off; anything else is checked against RoutingReplay."""
    if value is True:
        return "training"
    if value is False:
        return "off"
    return value


# The algorithm knobs of `rl` (their names as megatron_rl.algorithms spells them; the config
# module does not import torch, so the sets are repeated here and a unit test keeps them equal).
RecipeName = Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo", "olmo3"]
# Outcome-reward estimators (algorithms.ADVANTAGE_ESTIMATORS less grpo_process, which needs
# per-step rewards the trainer does not produce).
AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"]
LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                      "token-sum"]
RatioLevel = Literal["token", "sequence", "sequence_token"]
TisLevel = Literal["token", "sequence", "off"]
TisMode = Literal["truncate", "mask"]


def _off_value(value: Any) -> Any:
    """YAML reads a bare `off` as false: rl.tis_level: off / false mean "off"."""
    return "off" if value is False else value


def _check_choice(where: str, name: str, value: Any, hint: Any) -> None:
    allowed = typing.get_args(hint)
    if value is not None and value not in allowed:
        raise ConfigError(f"{where}.{name}: {value!r} is not one of {', '.join(map(repr, allowed))} (or null for "
                          f"the recipe's value)")


@dataclass
class RLConfig:
    """The RL loop: what one step generates, how it trains on it, and the algorithm."""

    # grpo | dr_grpo | dapo | gspo | cispo | olmo3 (megatron_rl.algorithms.recipes); the
    # algorithm fields below that are None keep the recipe's value.
    recipe: RecipeName = "dapo"
    kl_coef: float | None = None
    entropy_coef: float | None = None
    eps_low: float | None = None
    eps_high: float | None = None
    dynamic_sampling: bool | None = None
    # Group-relative advantage: grpo ((r - mean) / std), dr_grpo (r - mean), rloo (leave-one-out
    # mean), reinforce_plus_plus_baseline (r - group mean, whitened over the batch).
    advantage_estimator: AdvantageEstimator | None = None
    # Loss reduction: token-mean (DAPO), seq-mean-token-mean (GRPO), seq-mean-token-sum,
    # seq-mean-token-sum-norm (Dr. GRPO; L_norm = max_response_tokens), token-sum.
    loss_agg_mode: LossAggMode | None = None
    # Importance ratio: token (PPO), sequence (GSPO), sequence_token (GSPO-token).
    ratio_level: RatioLevel | None = None
    # DAPO overlong reward shaping: 0 up to overlong_max_length - overlong_buffer_length, then a
    # linear ramp to -overlong_penalty_factor at overlong_max_length. DAPO's 20480 / 4096 are its
    # generation budget and a fifth of it, so when the recipe shapes (dapo) or either length is set
    # here, a length left null follows that rule at this run's budget: overlong_max_length =
    # max_response_tokens and overlong_buffer_length = round(0.2 * overlong_max_length), at least 1
    # (DAPO's own numbers would never penalize a response budget up to 16384). A soft budget at or
    # beyond max_response_tokens is refused (it would never apply); overlong_penalty_factor: 0
    # turns shaping off.
    overlong_max_length: int | None = None
    overlong_buffer_length: int | None = None
    overlong_penalty_factor: float | None = None
    # Truncated responses (cut at max_response_tokens) leave the loss (DAPO overlong filtering).
    mask_truncated: bool | None = None
    # Train/inference mismatch correction (truncated importance sampling against the engine's
    # logprobs, weight pi_old_train / pi_rollout): tis_level token | sequence | off (null: the
    # recipe's; the olmo3 recipe has token-level TIS); tis_mode truncate (clip the weight to
    # [tis_lower, tis_upper]) | mask (weight 0 outside it). Setting tis_upper alone (e.g. 2.0)
    # turns token-level TIS on, as before.
    tis_level: TisLevel | None = field(default=None, metadata={"coerce": _off_value})
    tis_mode: TisMode | None = None
    tis_upper: float | None = None
    tis_lower: float | None = None
    # Samples may come from a policy at most this many versions older than the one being
    # updated; 0 = synchronous. At >= 1, unless tis_level is set, the loss is AReaL's decoupled
    # objective (arXiv:2505.24298): the PPO ratio against the proximal policy (old logprobs the
    # trainer recomputes at the step's start) times the behaviour weight proximal / engine,
    # which is token-level TIS, truncated at tis_upper (2.0 when null).
    max_staleness: int = 0
    # Dual clip for negative advantages (c > 1), None = off.
    dual_clip_c: float | None = None
    # Defaults: the built-in tiny run (about 3 minutes of RL on 2 CPU cores).
    steps: int = 150  # RL steps (one rollout batch each)
    prompts_per_step: int = 32
    group_size: int = 8  # samples per prompt (G)
    # Optimizer updates per rollout batch (mini-batches). With more than one, the old-policy
    # logprobs are recomputed before the first update and the ratio departs from 1.
    updates_per_rollout: int = 2
    max_response_tokens: int = 6
    temperature: float = 1.0
    top_p: float = 1.0
    # Dynamic sampling: extra generate rounds allowed to refill the batch after dropping groups
    # whose rewards are all equal.
    max_refill_rounds: int = 3
    # MoE routing across the forwards of a step (megatron_rl/model/routing.py):
    #   off       every forward routes by itself; `moe/routing_drift` counts the training
    #             forward's routes that differ from the old-logprob forward's
    #   training  the experts chosen in the old-logprob forward are replayed in the training
    #             forward (Megatron-Core router replay), so the ratio compares one routed network
    #   rollout   R3 (rollout routing replay): the rollout engine's own routes of every token it
    #             ran are replayed in the old-logprob, reference and training forwards, so the
    #             trainer computes the network the engine sampled from; `moe/rollout_routing_drift`
    #             counts the trainer's own choices that differ from the engine's. vLLM engines only.
    # true / false are read as training / off (YAML reads a bare `off` as false).
    routing_replay: RoutingReplay = field(default="off", metadata={"coerce": _routing_replay_value})
    eval_every: int = 25  # RL steps between held-out evaluations (0: only before and after)
    eval_prompts: int | None = None  # None: the whole held-out set
    eval_temperature: float = 0.0  # greedy by default: accuracy of the policy's best answer

    def __post_init__(self):
        self.routing_replay = _routing_replay_value(self.routing_replay)
        self.tis_level = _off_value(self.tis_level)

    def validate(self, where: str) -> None:
        if self.routing_replay not in typing.get_args(RoutingReplay):
            raise ConfigError(f"{where}.routing_replay: {self.routing_replay!r} is not one of "
                              f"{', '.join(map(repr, typing.get_args(RoutingReplay)))}")
        for name in ("steps", "prompts_per_step", "updates_per_rollout", "max_response_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}.{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ConfigError(f"{where}.group_size must be >= 2 (group-relative advantages need a group)")
        if self.prompts_per_step % self.updates_per_rollout:
            raise ConfigError(f"{where}.updates_per_rollout={self.updates_per_rollout} must divide "
                              f"prompts_per_step={self.prompts_per_step} (whole groups per update)")
        if self.max_refill_rounds < 0 or self.eval_every < 0:
            raise ConfigError(f"{where}.max_refill_rounds and eval_every must be >= 0")
        if not 0 < self.top_p <= 1 or self.temperature < 0 or self.eval_temperature < 0:
            raise ConfigError(f"{where}: temperature must be >= 0 and top_p in (0, 1]")
        self._validate_algorithm(where)
        if self.eval_prompts is not None and self.eval_prompts < 1:
            raise ConfigError(f"{where}.eval_prompts must be >= 1 or null")

    def _validate_algorithm(self, where: str) -> None:
        """The algorithm knobs, without building the recipe (that imports torch; trainer.preflight
        builds it and reports the loss config's own checks)."""
        for name, hint in (("recipe", RecipeName), ("advantage_estimator", AdvantageEstimator),
                           ("loss_agg_mode", LossAggMode), ("ratio_level", RatioLevel), ("tis_level", TisLevel),
                           ("tis_mode", TisMode)):
            _check_choice(where, name, getattr(self, name), hint)
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ConfigError(f"{where}.max_staleness must be an integer >= 0 (0 = synchronous), "
                              f"got {self.max_staleness!r}")
        for name in ("overlong_max_length", "overlong_buffer_length"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{where}.{name} must be an integer >= 1 (or null), got {value!r}")
        if (self.overlong_max_length is not None and self.overlong_buffer_length is not None
                and self.overlong_buffer_length > self.overlong_max_length):
            raise ConfigError(f"{where}.overlong_buffer_length={self.overlong_buffer_length} must be <= "
                              f"overlong_max_length={self.overlong_max_length}")
        factor = self.overlong_penalty_factor
        if factor is not None and not (factor >= 0 and factor != float("inf")):
            raise ConfigError(f"{where}.overlong_penalty_factor must be a finite number >= 0 (0 = no shaping), "
                              f"got {factor}")
        if self.overlong_max_length is not None or self.overlong_buffer_length is not None:
            self._overlong(None, None, where)  # lengths given here: do they ever apply? (DAPO's ratio, as dapo's)
        if self.tis_upper is not None and not 1 < self.tis_upper < float("inf"):
            raise ConfigError(f"{where}.tis_upper must be > 1 (or null), got {self.tis_upper}")
        if self.tis_lower is not None and not 0 < self.tis_lower < 1:
            raise ConfigError(f"{where}.tis_lower must be in (0, 1) (or null for no lower bound), got {self.tis_lower}")
        if self.tis_level == "off":
            given = [name for name in ("tis_mode", "tis_upper", "tis_lower") if getattr(self, name) is not None]
            if given:
                raise ConfigError(f"{where}.{given[0]} has no effect with tis_level=off; remove it or set tis_level "
                                  f"to token or sequence")

    def _overlong(self, recipe_max: int | None, recipe_buffer: int | None, where: str = "rl") -> dict[str, Any]:
        """The overlong-shaping overrides (see the field comment)."""
        if self.overlong_penalty_factor == 0:
            return {"overlong_max_length": None, "overlong_buffer_length": None}
        lengths = (recipe_max, self.overlong_max_length, self.overlong_buffer_length)
        if all(value is None for value in lengths):
            return {}
        # DAPO's buffer is a fifth of its budget (4096 / 20480); a recipe's own ratio if it has one.
        num, den = (recipe_buffer, recipe_max) if recipe_max is not None else (1, 5)
        length = self.overlong_max_length if self.overlong_max_length is not None else self.max_response_tokens
        buffer = self.overlong_buffer_length
        if buffer is None:
            buffer = max(1, (num * length + den // 2) // den)  # rounded half up, in integers
        if buffer > length:
            raise ConfigError(f"{where}.overlong_buffer_length={buffer} must be <= overlong_max_length={length}")
        if length - buffer >= self.max_response_tokens:
            raise ConfigError(
                f"{where}: overlong shaping would never apply: its soft budget overlong_max_length - "
                f"overlong_buffer_length = {length} - {buffer} = {length - buffer} is not below "
                f"max_response_tokens={self.max_response_tokens}; lower overlong_max_length (null = the "
                f"budget) or set overlong_penalty_factor: 0 for no shaping")
        return {"overlong_max_length": length, "overlong_buffer_length": buffer}

    def algorithm(self):
        """The recipe with this section's overrides (megatron_rl.algorithms.Recipe).

        Raises ConfigError for overlong lengths that cannot apply; the recipe's own checks raise
        ValueError (trainer.preflight reports them as ConfigError)."""
        from megatron_rl.algorithms import RECIPES, recipe

        base = RECIPES[self.recipe]
        names = ("kl_coef", "entropy_coef", "eps_low", "eps_high", "dynamic_sampling", "dual_clip_c",
                 "advantage_estimator", "loss_agg_mode", "ratio_level", "overlong_penalty_factor", "mask_truncated",
                 "tis_mode", "tis_upper", "tis_lower")
        overrides = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        overrides.update(self._overlong(base.overlong_max_length, base.overlong_buffer_length))
        if self.tis_level == "off":
            overrides["tis_level"] = None
        elif self.tis_level is not None:
            overrides["tis_level"] = self.tis_level
        elif base.loss.tis_level is None and (self.tis_upper is not None or self.max_staleness >= 1):
            # tis_upper alone turns token-level TIS on; so does an asynchronous run (AReaL's
            # decoupled objective: the behaviour weight pi_prox / pi_behav, truncated).
            overrides["tis_level"] = "token"
        tis_on = overrides.get("tis_level", base.loss.tis_level) is not None
        if not tis_on and (self.tis_mode is not None or self.tis_lower is not None):
            name = "tis_mode" if self.tis_mode is not None else "tis_lower"
            raise ConfigError(f"{name} has no effect: TIS is off (recipe {self.recipe} has none); set tis_level or "
                              f"tis_upper")
        chosen = recipe(self.recipe, **overrides)
        if chosen.loss.loss_agg_mode == "seq-mean-token-sum-norm" and chosen.loss.l_norm is None:
            # Dr. GRPO divides by a constant: the generation budget, as in the paper.
            chosen = recipe(self.recipe, **overrides, l_norm=self.max_response_tokens)
        return chosen


@dataclass
class WarmStartConfig:
    """Supervised warm start before RL (the built-in default learns its task format this way):
    next-token loss on the targets of the training prompts."""

    steps: int = 250  # 0 = none (the default is the built-in tiny run's)
    batch_size: int = 64
    lr: float = 3e-3

    def validate(self, where: str) -> None:
        if self.steps < 0 or self.batch_size < 1 or self.lr <= 0:
            raise ConfigError(f"{where}: steps must be >= 0, batch_size >= 1 and lr > 0")


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
    # Resuming a checkpoint written with another config is refused (naming the keys) unless true;
    # the layout, logging and checkpoint keys may always differ.
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
        if self.rl.routing_replay == "rollout":
            if self.rollout.engine != "vllm":
                raise ConfigError(f"{where}: rl.routing_replay=rollout needs the rollout engine's routes, which only "
                                  f"the vLLM engines return here (rollout.engine={self.rollout.engine}); use "
                                  "rl.routing_replay=training")
            if self.parallel.cp > 1:
                raise ConfigError(f"{where}: rl.routing_replay=rollout maps the engine's routes onto whole packed "
                                  f"sequences and does not support context parallelism (parallel.cp={self.parallel.cp})")
        self._validate_async(where)
        self.warm_start.validate(f"{where}: warm_start")
        self.data.validate(f"{where}: data")
        self.rewards.validate(f"{where}: rewards")
        self.checkpoint.validate(f"{where}: checkpoint")
        self._validate_fp8_rollout(where)
        # The recipe overrides are checked by trainer.preflight (building a Recipe imports torch).
        return self

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
        loaded = _read_yaml(path)
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping, got {type(loaded).__name__}")
        raw = loaded
    for item in overrides or []:
        _apply_override(raw, item)
    config = _build(RunConfig, raw, source=source, prefix="")
    return config.validate(source)


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first_line: int, second_line: int):
        super().__init__(key, first_line, second_line)
        self.key, self.first_line, self.second_line = key, first_line, second_line


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML silently keeps the last,
    so a recipe edited in two places would run with whichever value happens to come later)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *anchor` then overriding a merged key is not a duplicate
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise _DuplicateKey(key, seen[key], line)
                    seen[key] = line
                except TypeError:
                    pass  # an unhashable key: SafeLoader reports it below
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> Any:
    """The parsed content of a YAML config file, with errors that name the file."""
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; --config expects a YAML file "
                          "(e.g. configs/tiny_cpu.yaml)")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        return yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except _DuplicateKey as dup:
        raise ConfigError(f"{path}: key {dup.key!r} is given twice (line {dup.first_line} and line "
                          f"{dup.second_line}); keep one of them") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc


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
        # A field may name a function that maps accepted spellings first (rl.routing_replay: true).
        value = fields[name].metadata.get("coerce", lambda given: given)(value)
        values[name] = _coerce(hints[name], value, source, f"{prefix}{name}")
    return cls(**values)


def _coerce(hint: Any, value: Any, source: str, key: str) -> Any:
    where = f"{source}: {key}"
    origin = typing.get_origin(hint)
    if isinstance(hint, type) and hasattr(hint, "from_dict"):
        # Sections with list-of-mapping fields (rewards.terms) parse themselves.
        return hint.from_dict(value if value is not None else {}, key)
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
    if origin is dict:
        # Name mappings (data.columns); keys are checked like values, errors name "key.<name>".
        key_hint, value_hint = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return {_coerce(key_hint, k, source, key): _coerce(value_hint, v, source, f"{key}.{k}")
                for k, v in value.items()}
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported config type {hint}")  # a bug in this module, not input


def to_dict(config: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)
