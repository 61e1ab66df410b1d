"""The model, its parallel layout and the optimizer: what Megatron-Core builds and trains."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, Mapping

from megatron_rl.errors import ConfigError

Precision = Literal["fp32", "bf16"]
Fp8Recipe = Literal["delayed", "current", "blockwise", "mxfp8"]
Dispatcher = Literal["alltoall", "allgather"]
LoraTarget = Literal["qkv", "proj", "fc1", "fc2", "experts", "router"]
LORA_TARGETS: tuple[str, ...] = ("qkv", "proj", "fc1", "fc2", "experts", "router")
# Bounds of model.lora. A rank above the narrowest adapted layer's width adds nothing (preflight
# refuses it against the model's dimensions: model/layout_checks.py); this bound stops a typo before
# the model is read: rank 2,000,000 held 6.15 GB after 10 s, 10^9 died in the allocator.
MAX_LORA_RANK = 1 << 16
# The merged weight is W + (alpha / rank) B A. PEFT's usual alpha is rank to 2 x rank (16 at rank 8);
# beyond 1e6 the adapters' update swamps the base at the first step, and 1e308 overflowed the merged
# weights to infinity (bridge/lora_merge.py refuses a non-finite merge too).
MAX_LORA_ALPHA = 1e6
# Megatron pads the embedding to a multiple of make_vocab_size_divisible_by x TP rows, and builds
# padded_vocab_size rows when it is set: each row is allocated. A vocabulary beyond 2^25 rows is a
# typo (config.json's vocab_size is read up to 2^24).
MAX_VOCAB_ROWS = 1 << 25
# The throughput levers at their defaults (off): model/throughput_levers.py; the planner builds
# its probe model with these, since no lever changes a parameter. Read-only: it is spread into
# other configs' constructors.
LEVERS_OFF: Mapping[str, object] = MappingProxyType({
    "gradient_accumulation_fusion": False, "moe_grouped_gemm_backend": "cublas", "moe_router_fusion": False,
    "moe_permute_fusion": False, "moe_router_padding_for_fp8": False,
})


@dataclass
class LoraConfig:
    """Low-rank adapters (model/lora.py): only they train, the base model is frozen. The engines
    and the HF export get the merged weights W + (alpha / rank) B A."""

    rank: int = 8
    # The adapter's output is scaled by alpha / rank (so a change of rank keeps its size).
    alpha: float = 16.0
    # Dropout on the adapters' input while training (0: none; the logprob passes never drop).
    dropout: float = 0.0
    # Where: qkv (attention's input projections: the fused QKV, or multi-latent attention's q and kv
    # down and up projections), proj (attention output), fc1 / fc2 (dense MLP and
    # shared experts), experts (every routed expert's fc1 and fc2, per expert), router (the MoE
    # gate). None: every one of them the model has, except router. One the model lacks is refused.
    targets: list[LoraTarget] | None = None
    # A's initial values (B starts at zero either way, so step 0 is the base model exactly):
    # kaiming: uniform in +-1/sqrt(fan_in) (PEFT's default); gaussian: normal, std 1/rank.
    init: Literal["kaiming", "gaussian"] = "kaiming"

    def validate(self, where: str) -> None:
        if self.rank < 1:
            raise ConfigError(f"{where}.rank must be >= 1 (the adapters' inner dimension), got {self.rank}")
        if self.rank > MAX_LORA_RANK:
            raise ConfigError(f"{where}.rank must be at most {MAX_LORA_RANK} (the adapters' inner dimension; a rank "
                              f"above the adapted layers' width adds nothing), got {self.rank}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ConfigError(f"{where}.alpha must be a finite number > 0 (the adapters' scale is alpha / rank), "
                              f"got {self.alpha}")
        if self.alpha > MAX_LORA_ALPHA:
            raise ConfigError(f"{where}.alpha must be at most {MAX_LORA_ALPHA:g} (the merged weight is W + (alpha / "
                              f"rank) B A; PEFT's usual alpha is rank to 2 x rank), got {self.alpha:g}")
        if not (math.isfinite(self.dropout) and 0 <= self.dropout < 1):
            raise ConfigError(f"{where}.dropout must be in [0, 1), got {self.dropout}")
        if self.targets is not None:
            if not self.targets:
                raise ConfigError(f"{where}.targets is empty: name at least one of {', '.join(LORA_TARGETS)} "
                                  "(or leave it null for every one the model has)")
            repeated = sorted({t for t in self.targets if self.targets.count(t) > 1})
            if repeated:
                raise ConfigError(f"{where}.targets names {repeated[0]!r} twice")


@dataclass
class ModelConfig:
    # A Hugging Face config.json (file or directory holding one), or the name of a preset shipped
    # with the package (see megatron_rl/model/presets/).
    hf_config: str = "tiny-qwen3-moe"
    # The model's shape where the download named by hf_config is not at hand (a preset name or a
    # config.json): `megatron-rl plan` reads it. When hf_config loads too, both must agree.
    architecture: str | None = None
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
    # Megatron's fused token permutation: TE's moe_permute/moe_unpermute kernels sort tokens to
    # their experts and back in one kernel each, instead of a chain of small torch ops per
    # micro-batch (the per-expert host work that bounds a 128-expert layer on one GPU). Needs the
    # Transformer Engine layer spec (its kernels are CUDA-only). False = Megatron's torch path.
    moe_permute_fusion: bool = False
    # ---- Throughput levers: each off until a GPU measurement shows it wins (model/throughput_levers.py
    # checks them before the model is built and maps them onto Megatron-Core's TransformerConfig).
    # Transformer Engine writes each weight gradient straight into Megatron DDP's fp32 main_grad
    # buffer (TE's fuse_wgrad_accumulation) instead of a per-weight temporary that DDP then adds:
    # one GEMM epilogue and no 128-experts' worth of wgrad buffers per layer. The update stays
    # exact: the policy always trains under Megatron DDP, whose main_grad views are the buffers the
    # step zeroes (zero_grad_buffer, also resetting grad_added_to_main_grad), DP-reduces by sum
    # (calculate_per_token_loss: the loss is already normalized over the whole step), checks for
    # non-finite values, clips and hands to the optimizer; each micro-batch's wgrad is added once,
    # in fp32 before rounding (a bf16 model's wgrad is not first rounded to bf16: equal or closer to
    # the float64 sum). A tied embedding's two uses are kept (Megatron marks it zero_out_wgrad), and
    # the KL reference, teacher and conversion models run no backward. Needs the TE layer spec on
    # CUDA and APEX's fused_weight_gradient_mlp_cuda (Megatron-Core's own output layer takes the
    # same flag and refuses to build without it); not with lora (its adapters are local-spec
    # linears with a backward of their own).
    gradient_accumulation_fusion: bool = False
    # TE's grouped GEMM for the experts. cutlass: one SM90 CUTLASS kernel per grouped op instead of
    # one cuBLAS GEMM per expert over 4 streams (NVTE_USE_CUTLASS_GROUPED_GEMM=1, set in-process when
    # the model is built; TE reads it at every grouped GEMM, so the key decides, not the shell).
    # TE 2.11 takes it only on compute capability 9.0 and only where A, B and the output share a
    # BF16/FP16 dtype, with no bias/GELU epilogue and one K for all experts with K % 128 == 0: forward
    # and dgrad qualify at Qwen3-30B shapes; the weight gradient never does (K = tokens per expert
    # varies; a fused wgrad writes fp32 main_grad) and falls back to cuBLAS, logged by
    # NVTE_CUTLASS_GROUPED_GEMM_WARN_FALLBACK=1 (one line per wgrad grouped GEMM). FP8 operands always
    # fall back, so cutlass with an fp8_recipe is refused (it would change nothing), as are GPUs other
    # than 9.0 (cuBLAS there, silently) and hidden or expert widths per rank not multiples of 128.
    moe_grouped_gemm_backend: Literal["cublas", "cutlass"] = "cublas"
    # TE's fused top-k/softmax-or-sigmoid router kernel (TE >= 2.7; TE layer spec, MoE). It skips the
    # router's replay hook, through which routing replay, the routing-drift record and the DeepSeek
    # group-limited rule (model/moe_router.py) run: refused with rl.routing_replay other than off,
    # with an old-logprob pass (rl.updates_per_rollout > 1, or off-policy masks), and for
    # group-limited routers. Same top-k as the unfused path otherwise.
    moe_router_fusion: bool = False
    # No CUDA-graph lever (Megatron-Core's cuda_graph_impl / cuda_graph_scope) is offered: a graph
    # replays only the shape it captured, and this trainer's micro-batches are padding-free packs
    # whose token and sequence counts vary; Transformer Engine's graphs are also captured by a
    # training-loop helper this trainer does not run. The scopes that keep every token (attn,
    # moe_router, moe_preprocess) would need static-shape micro-batches (packs padded to a fixed
    # token and sequence count) first; whole-MoE, whole-layer and whole-step scopes (moe, full,
    # full_iteration) need drop-and-pad experts besides (capacity factor + pad to capacity), which
    # drop tokens and so change the logprobs the rollout engine computed.
    # FP8: the router pads each expert's token count to the FP8 alignment (16, 32 for mxfp8) with
    # zero-probability routes instead of TE padding rows inside the experts (Megatron-Core's
    # moe_router_padding_for_quantization): padded tokens add 0 x output, the logprobs are
    # unchanged. Needs fp8_recipe, an MoE model and the alltoall dispatcher.
    moe_router_padding_for_fp8: bool = False
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
    # Activation recomputation. "full": every layer keeps only its input and recomputes its
    # forward during the backward (Megatron's full/uniform granularity, one layer per checkpoint):
    # activations shrink to about one layer's plus a hidden state per layer, for ~1/3 more compute.
    recompute: Literal["none", "full"] = "none"
    # Low-rank adapters (null: full fine-tuning). See LoraConfig.
    lora: LoraConfig | None = None

    @property
    def fp8_bf16_layers(self) -> bool:
        return self.fp8_bf16_first_layers > 0 or self.fp8_bf16_last_layers > 0

    def validate(self, where: str) -> None:
        if not 1 <= self.make_vocab_size_divisible_by <= 1 << 16:
            raise ConfigError(f"{where}.make_vocab_size_divisible_by must be from 1 to 65536 (the embedding is padded "
                              f"to a multiple of it x TP, every row allocated), got {self.make_vocab_size_divisible_by}")
        if self.padded_vocab_size is not None and not 1 <= self.padded_vocab_size <= MAX_VOCAB_ROWS:
            raise ConfigError(f"{where}.padded_vocab_size must be from 1 to {MAX_VOCAB_ROWS} (every row is allocated), "
                              f"got {self.padded_vocab_size}")
        if self.moe_aux_loss_coeff < 0:
            raise ConfigError(f"{where}.moe_aux_loss_coeff must be >= 0")
        if self.moe_router_bias_update_rate < 0:
            raise ConfigError(f"{where}.moe_router_bias_update_rate must be >= 0, got {self.moe_router_bias_update_rate}")
        self._validate_fp8(where)
        self._validate_throughput_levers(where)
        if self.lora is not None:
            self.lora.validate(f"{where}.lora")
            if self.layer_spec == "transformer_engine":
                raise ConfigError(f"{where}.lora is built on the local layer spec's linears (Transformer Engine's "
                                  "fused and grouped linears take no adapters yet): set layer_spec: local")
            if self.fp8_recipe is not None or self.fp8_param:
                raise ConfigError(f"{where}.lora with FP8 training (fp8_recipe / fp8_param) is not built: the "
                                  "adapters sit on the local layer spec's linears; train LoRA in bf16 or fp32")

    def _validate_throughput_levers(self, where: str) -> None:
        """The levers' settings that are wrong on any machine (GPU, TE and model checks come at
        build time: model/throughput_levers.py)."""
        if self.moe_router_padding_for_fp8 and self.fp8_recipe is None:
            raise ConfigError(f"{where}.moe_router_padding_for_fp8=true pads expert token counts to the FP8 alignment: "
                              "it needs fp8_recipe (set one, or leave it false)")
        if self.moe_router_padding_for_fp8 and self.moe_token_dispatcher == "allgather":
            raise ConfigError(f"{where}.moe_router_padding_for_fp8=true needs moe_token_dispatcher: alltoall "
                              "(Megatron-Core's allgather dispatcher cannot pad the routing map)")
        if self.moe_grouped_gemm_backend == "cutlass" and self.fp8_recipe is not None:
            raise ConfigError(
                f"{where}.moe_grouped_gemm_backend=cutlass with fp8_recipe={self.fp8_recipe!r}: Transformer Engine's "
                "CUTLASS grouped GEMM takes BF16/FP16 operands only, so every FP8 expert GEMM would fall back to "
                "cuBLAS; use moe_grouped_gemm_backend: cublas with FP8")
        if self.lora is not None:
            levers = [name for name, off in LEVERS_OFF.items() if getattr(self, name) != off]
            if levers:
                raise ConfigError(
                    f"{where}.{levers[0]} with lora: the adapters are built on the local layer spec's linears, and "
                    "this lever is Transformer Engine's (the TE layer spec); leave it at its default with lora")

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


# Above this a learning rate is a typo (1e30 for 1e-3 in the audit that added the check): Adam's
# step moves every weight by about lr, so lr = 1 already rewrites a model's weights in one update.
MAX_LEARNING_RATE = 1.0


def check_finite(where: str, name: str, value) -> None:
    if value is not None and not math.isfinite(value):
        raise ConfigError(f"{where}.{name} must be a finite number, got {value}")


def check_learning_rate(key: str, lr: float) -> None:
    if not (math.isfinite(lr) and 0 < lr <= MAX_LEARNING_RATE):
        raise ConfigError(f"{key} must be a finite number in (0, {MAX_LEARNING_RATE:g}], got {lr}; a value "
                          f"like 1e-6 .. 1e-3 is usual (Adam moves each weight by about lr per update)")


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
        # NaN compares False with everything, so each bound below would let it through: finiteness first.
        for name in ("lr", "min_lr", "weight_decay", "adam_eps", "clip_grad"):
            check_finite(where, name, getattr(self, name))
        check_learning_rate(f"{where}.lr", self.lr)
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
