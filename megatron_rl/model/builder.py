"""Build the Megatron-Core policy (`GPTModel`) described by a Hugging Face config.

    arch = parse_hf_config(*load_hf_config(config.model.hf_config))
    tconfig = transformer_config(arch, config, device)
    model = build_gpt_model(arch, tconfig, config.model, use_te=...)

The layer spec is Transformer Engine's when TE and CUDA are both present (fused attention that
handles packed `thd` batches, TE linears with fused norms, grouped-GEMM experts, FP8), and the
local spec otherwise, with our `VarlenDotProductAttention` in place of the local attention so
packed batches work on CPU too. Both layouts export the same HF names (bridge/placement.py).
FP8 recipes are checked against the machine in model/fp8.py before anything is built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util

import torch
import torch.nn.functional as F

from megatron_rl.config import ModelConfig, RunConfig

from megatron_rl.errors import ConfigError
from megatron_rl.model import fp8, throughput_levers
from megatron_rl.model.hf_config import ArchitectureSpec
from megatron_rl.model.layout_checks import check_divisibility  # noqa: F401  (re-exported)


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available()


def use_transformer_engine(model: ModelConfig, device: torch.device) -> bool:
    if model.layer_spec == "local":
        return False
    available = device.type == "cuda" and transformer_engine_available()
    if model.layer_spec == "transformer_engine" and not available:
        raise ConfigError(
            "model.layer_spec=transformer_engine needs CUDA and the transformer-engine package "
            "(install the 'gpu' extra); use layer_spec: auto or local on this machine"
        )
    return available


def use_grouped_gemm(model: ModelConfig, use_te: bool) -> bool:
    """Grouped-GEMM experts (TE's TEGroupedMLP) with the TE spec; one expert at a time otherwise.

    The local spec's grouped experts are Megatron's legacy GroupedMLP: it needs the separate
    grouped_gemm package and fuses all experts into one weight the bridge does not map.
    """
    if model.moe_grouped_gemm is None:
        return use_te
    if model.moe_grouped_gemm and not use_te:
        raise ConfigError(
            "model.moe_grouped_gemm=true needs the Transformer Engine layer spec (CUDA and the "
            "transformer-engine package); leave it unset (auto) or false with the local spec"
        )
    return model.moe_grouped_gemm


def use_permute_fusion(model: ModelConfig, use_te: bool) -> bool:
    """TE's fused permute/unpermute kernels for the MoE token dispatch: only with the TE spec."""
    if model.moe_permute_fusion and not use_te:
        raise ConfigError(
            "model.moe_permute_fusion=true needs the Transformer Engine layer spec (CUDA and the "
            "transformer-engine package: its permute kernels are CUDA-only); leave it false on this machine"
        )
    return model.moe_permute_fusion


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: pad to a multiple of divisible_by * tp so every TP shard is equal."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def model_vocab_rows(arch: ArchitectureSpec, model: ModelConfig, tp: int) -> int:
    """Embedding rows to build: a recorded padded size if given (it must split over TP), else the rule."""
    if model.padded_vocab_size is None:
        return padded_vocab_size(arch.vocab_size, model.make_vocab_size_divisible_by, tp)
    rows = model.padded_vocab_size
    if rows < arch.vocab_size or rows % tp:
        raise ConfigError(
            f"model.padded_vocab_size={rows} must be >= the vocabulary ({arch.vocab_size}) and divisible by "
            f"parallel.tp={tp}; this checkpoint cannot be loaded at tp={tp} without re-padding "
            "(convert it through HF: tools/convert_megatron_to_hf.py then tools/convert_hf_to_megatron.py)"
        )
    return rows


def check_fp8(model: ModelConfig, device: torch.device, use_te: bool, hardware: fp8.Hardware | None = None) -> None:
    """The FP8 recipe against this machine (see model/fp8.py); nothing without FP8."""
    if model.fp8_recipe is not None:
        fp8.check_recipe(model, hardware or fp8.detect_hardware(device), use_te)


def transformer_config(
    arch: ArchitectureSpec, config: RunConfig, device: torch.device, use_te: bool, hardware: fp8.Hardware | None = None
):
    """`hardware` describes the machine for the FP8 checks (detected from `device` if not given)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel = config.parallel
    parallel.validate_for_model("parallel", num_experts=arch.num_experts)
    check_divisibility(arch, config)
    grouped_gemm = arch.is_moe and use_grouped_gemm(config.model, use_te)
    if config.model.fp8_recipe is not None:
        hardware = hardware or fp8.detect_hardware(device)
        fp8.check_fp8(config, arch, hardware, use_te=use_te, grouped_gemm=grouped_gemm)
    if throughput_levers.levers_on(config.model):
        hardware = hardware or fp8.detect_hardware(device)
        throughput_levers.check_levers(config, arch, hardware, use_te=use_te, grouped_gemm=grouped_gemm)
    bf16 = config.model.precision == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    moe: dict = {}
    if arch.is_moe:
        moe = _router_fields(arch, config.model)
        moe.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_top_k,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            moe_layer_freq=[1 if sparse else 0 for sparse in arch.moe_layer_pattern],
            # HF: softmax over all experts, top-k, then renormalize if norm_topk_prob. Megatron
            # without pre_softmax takes top-k logits then softmaxes them: the same numbers as
            # renormalizing; pre_softmax keeps the un-renormalized top-k probabilities.
            moe_router_pre_softmax=not arch.moe_norm_topk_prob and arch.moe_router_score == "softmax",
            # Gives every router a RouterReplay hook: no effect unless a RouterTrace drives it
            # (routing replay and the routing-drift metric, megatron_rl/model/routing.py).
            moe_enable_routing_replay=True,
            moe_router_dtype="fp32",
            moe_token_dispatcher_type=config.model.moe_token_dispatcher,
            moe_router_load_balancing_type="aux_loss" if config.model.moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=config.model.moe_aux_loss_coeff,
            moe_grouped_gemm=grouped_gemm,
            moe_permute_fusion=use_permute_fusion(config.model, use_te),
        )
    else:
        # Megatron validates the dispatcher even for dense models; its default (allgather)
        # refuses variable_seq_lengths.
        moe = dict(moe_token_dispatcher_type="alltoall")
    if arch.is_moe and parallel.pp > 1 and config.model.moe_token_dispatcher == "allgather":
        raise ConfigError(
            "model.moe_token_dispatcher=allgather cannot run with parallel.pp > 1 (Megatron-Core "
            "needs fixed sequence lengths for it, and packed micro-batches vary); use alltoall"
        )
    config_class, attention = TransformerConfig, {}
    if arch.mla is not None:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        _repair_mla_without_transformer_engine()
        config_class, attention = MLATransformerConfig, _mla_fields(arch)
    return config_class(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        # MLA's q_layernorm / kv_layernorm are its latent norms (q_a_layernorm, kv_a_layernorm).
        qk_layernorm=arch.qk_norm or arch.mla is not None,
        hidden_dropout=0.0,
        attention_dropout=arch.attention_dropout,
        init_method_std=arch.initializer_range,
        # Fused kernels are CUDA-only; the unfused paths compute the same function.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        num_layers_in_first_pipeline_stage=parallel.pp_first_stage_layers,
        num_layers_in_last_pipeline_stage=parallel.pp_last_stage_layers,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tp,
        context_parallel_size=parallel.cp,
        sequence_parallel=parallel.uses_sequence_parallel,
        # Packed micro-batches have different lengths; pipeline stages must exchange shapes.
        variable_seq_lengths=parallel.pp > 1,
        # Our loss is already divided by the whole step's normalizer (see model/policy.py), so
        # Megatron must neither divide by the micro-batch count nor average over DP.
        calculate_per_token_loss=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
        use_cpu_initialization=device.type == "cpu",
        **_recompute_fields(config.model),
        **moe,
        **attention,
        **fp8.transformer_config_fields(config.model),
        **throughput_levers.transformer_config_fields(config.model, arch),
    )


def _recompute_fields(model: ModelConfig) -> dict:
    if model.recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return {}


def _router_fields(arch: ArchitectureSpec, model: ModelConfig) -> dict:
    """DeepSeek-V3 / GLM-4.5 routing: sigmoid scores, the score-correction bias (Megatron-Core's
    expert bias: a float32 buffer added to the scores for the choice only), groups, scaling, and
    the shared experts (one fused MLP of n_shared_experts * moe_intermediate_size, no gate)."""
    if arch.moe_router_score != "sigmoid":
        return {}
    return dict(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=arch.moe_expert_bias,
        # Aux-loss-free balancing: the bias moves by this much per step toward even expert loads
        # (0 keeps the checkpoint's bias fixed, the default for RL fine-tuning).
        moe_router_bias_update_rate=model.moe_router_bias_update_rate,
        moe_router_num_groups=arch.moe_num_groups,
        moe_router_group_topk=arch.moe_group_topk,
        moe_router_topk_scaling_factor=arch.moe_routed_scaling_factor,
        moe_shared_expert_intermediate_size=arch.moe_shared_ffn_hidden_size,
    )


def _repair_mla_without_transformer_engine() -> None:
    """Megatron-Core 0.16.1's MLA sets HAVE_TE when its TE extension module imports, which it does
    without Transformer Engine installed (the TE classes are then placeholders, not classes), and
    then calls isinstance(..., TELinear) while building every MLA layer. Record the truth; idempotent."""
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False
    _repair_local_kv_down_projection(multi_latent_attention.MLASelfAttention)


def _repair_local_kv_down_projection(attention_class) -> None:
    """Without Transformer Engine, Megatron-Core 0.16.1's MLA builds its KV down-projection as a
    ColumnParallelLinear and gathers the output's columns over TP. The rotary part of that output
    (k_pos_emb) then feeds every rank's own attention heads, but the gather's backward only keeps
    this rank's columns of this rank's gradient: the other heads' share of k_pos_emb's gradient is
    lost. Measured at TP2 on a tiny DeepSeek-V3: loss equal to one process, grad norm 1% off
    (every parameter upstream of a k_pos_emb, relative errors 2e-3 to 5e-3). With TE the
    projection is a replicated ("duplicated") linear on the sequence-parallel slice and k_pos_emb is
    gathered over the sequence, whose backward sums every rank's share.

    The repair makes the local projection return what the TE one does: its columns gathered over
    TP, then this rank's sequence slice. MLA then takes its TE path for the rest (k_pos_emb
    gathered over the sequence, backward reduce-scattered: summed over TP); the gather's backward
    keeps this rank's columns of a gradient now complete on every rank. Only with sequence
    parallelism, which TP > 1 always uses here (config/model.py refuses it off). Idempotent."""
    if getattr(attention_class, "_kv_down_projection_repaired", False):
        return
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.tensor_parallel.mappings import (
        gather_from_tensor_model_parallel_region,
        scatter_to_sequence_parallel_region,
    )

    original_init = attention_class.__init__

    def __init__(self, config, *args, **kwargs):
        original_init(self, config, *args, **kwargs)
        projection = self.linear_kv_down_proj
        if type(projection) is not ColumnParallelLinear or not config.sequence_parallel:
            return
        group = projection.tp_group if hasattr(projection, "tp_group") else None
        if group is None or group.size() == 1:
            return

        def forward(hidden_states, *f_args, **f_kwargs):
            # Through the class at call time: LoRA gives the built projection its adapter
            # (model/lora.py adapt_mla_down_projections changes its class).
            output, bias = type(projection).forward(projection, hidden_states, *f_args, **f_kwargs)  # [s, b, n / tp]
            output = gather_from_tensor_model_parallel_region(output, group=group)  # [s, b, n]
            return scatter_to_sequence_parallel_region(output, group=group), bias  # [s / tp, b, n]

        projection.forward = forward

    attention_class.__init__ = __init__
    attention_class._kv_down_projection_repaired = True


def _mla_fields(arch: ArchitectureSpec) -> dict:
    """Multi-latent attention and its RoPE (plain or YaRN) for MLATransformerConfig."""
    mla, yarn = arch.mla, arch.yarn
    fields = dict(
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim,
        qk_pos_emb_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        rotary_base=arch.rope_theta,
        rope_type="yarn" if yarn else "rope",
        rotary_percent=1.0,
    )
    if yarn:
        fields.update(
            rotary_scaling_factor=yarn.factor,
            original_max_position_embeddings=yarn.original_max_position_embeddings,
            beta_fast=yarn.beta_fast,
            beta_slow=yarn.beta_slow,
            mscale=yarn.mscale,
            mscale_all_dim=yarn.mscale_all_dim,
        )
    else:
        # MLA's softmax scale uses get_mscale(rotary_scaling_factor, mscale_all_dim): 1 without YaRN.
        fields.update(mscale=1.0, mscale_all_dim=0.0)
    return fields


def layer_spec(tconfig, use_te: bool):
    """The decoder block spec for this model (dense and MoE layers as the pattern says)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_rl.model.varlen_attention import VarlenDotProductAttention

    block = get_gpt_decoder_block_spec(tconfig, use_transformer_engine=use_te, normalization="RMSNorm")
    for spec in block.layer_specs:
        if not use_te:
            spec.submodules.self_attention.submodules.core_attention = VarlenDotProductAttention
        mlp = spec.submodules.mlp
        if tconfig.moe_router_group_topk and hasattr(getattr(mlp, "submodules", None), "router"):
            from megatron_rl.model.moe_router import GroupLimitedRouter

            mlp.submodules.router = GroupLimitedRouter
    return block


def build_gpt_model(arch: ArchitectureSpec, tconfig, model: ModelConfig, use_te: bool, vp_stage=None):
    """One pipeline stage of the policy (this rank's layers; embedding/head where they belong)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    block = layer_spec(tconfig, use_te)
    lora_settings = _add_lora(block, arch, model, tconfig, use_te) if model.lora is not None else None
    gpt = GPTModel(
        config=tconfig,
        transformer_layer_spec=block,
        vocab_size=model_vocab_rows(arch, model, tconfig.tensor_model_parallel_size),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,  # keep logits vocab-sharded: logprobs never gather the vocabulary
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        rotary_percent=arch.rotary_percent,
    )
    if lora_settings is not None:
        from megatron_rl.model.lora import adapt_mla_down_projections, freeze_base, keep_layer_inputs_differentiable

        settings, targets = lora_settings
        if arch.mla is not None and "qkv" in targets:
            adapt_mla_down_projections(gpt, settings)
        freeze_base(gpt)  # here, so the planner's model on the meta device is frozen as training's is
        if model.recompute != "none":
            keep_layer_inputs_differentiable(gpt)
    return gpt


def _add_lora(block, arch: ArchitectureSpec, model: ModelConfig, tconfig, use_te: bool):
    """Adapters into the layer spec (model/lora.py), on the targets the model has.
    Returns (the adapters' settings, the targets)."""
    from megatron_rl.model import lora
    from megatron_rl.model.layout_checks import lora_targets

    if use_te:
        raise ConfigError("model.lora is built on the local layer spec's linears; set model.layer_spec=local "
                          "(Transformer Engine's fused and grouped linears take no adapters yet)")
    settings = lora.LoraSettings(rank=model.lora.rank, alpha=model.lora.alpha, dropout=model.lora.dropout,
                                 init=model.lora.init)
    targets = lora_targets(model.lora, arch)
    lora.apply_to_layer_spec(block, settings, targets, gated=tconfig.gated_linear_unit)
    return settings, targets


@dataclasses.dataclass
class BuiltModel:
    raw_hf_config: dict  # the config.json as given (written back by conversion tools)
    arch: ArchitectureSpec
    tconfig: object  # megatron TransformerConfig
    module: object  # this rank's GPTModel stage, on the runtime's device
    use_te: bool


def _define_router_gemm_without_te() -> None:
    """Megatron-Core 0.16.1's MoE router tests `te_general_gemm is not None`, but defines the name
    only when Transformer Engine imports: without TE every MoE forward raised NameError, on any
    device (seen on an H200 without TE; the CPU layer had the same repair for CPU only). None is
    the value its own code expects for "no TE". Idempotent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def tag_split_dims(module) -> None:
    """What Megatron-Core's initialization does besides drawing the values, and skips with
    perform_initialization=False: tag each tensor-parallel weight with the dimension it is split
    along (`tensor_model_parallel`, `partition_dim`; the bridge reads them). The stride is left
    at 1: nothing that loads or exports weights reads it."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for layer in module.modules():
        weight = getattr(layer, "weight", None)
        if not isinstance(weight, torch.nn.Parameter) or hasattr(weight, "tensor_model_parallel"):
            continue
        if isinstance(layer, RowParallelLinear):
            set_tensor_model_parallel_attributes(weight, True, 1, 1)
        elif isinstance(layer, (ColumnParallelLinear, VocabParallelEmbedding)):
            set_tensor_model_parallel_attributes(weight, True, 0, 1)


def build_model(config: RunConfig, device: torch.device, *, initialize: bool = True, meta: bool = False) -> BuiltModel:
    """This rank's stage of the model described by config.model (parallel state must be up).

    `initialize=False` leaves the weights uninitialized, for callers that load every one of them
    (the conversion tools): on the CPU Megatron-Core draws each weight whole in fp32, casts and
    splits it, which took a third of a conversion's time, with a transient fp32 copy of the
    largest weight; only the tensor-parallel tags are kept (tag_split_dims). `meta=True`: every
    weight on the meta device (shapes, dtypes and checkpoint keys, no memory), for the streamed
    conversion that reads each one only while writing it (bridge/streamed.py)."""
    from megatron_rl.model.hf_config import load_hf_config, parse_hf_config

    raw, where = load_hf_config(config.model.hf_config)
    arch = parse_hf_config(raw, where)
    use_te = use_transformer_engine(config.model, device)
    if arch.is_moe:
        _define_router_gemm_without_te()
    tconfig = transformer_config(arch, config, device, use_te)
    throughput_levers.select_grouped_gemm_backend(config.model, grouped_gemm=use_te and tconfig.moe_grouped_gemm)
    tconfig.perform_initialization = initialize and not meta
    with torch.device("meta") if meta else contextlib.nullcontext():
        module = build_gpt_model(arch, tconfig, config.model, use_te)
    if not initialize or meta:
        tag_split_dims(module)
    if config.model.lora is not None and initialize and not meta:
        from megatron_rl.model.lora import init_adapters

        init_adapters(module, config.seed)
    if device.type == "cuda":
        module = module.cuda(device)
    return BuiltModel(raw, arch, tconfig, module, use_te)
