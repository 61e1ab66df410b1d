"""Read a Hugging Face `config.json` into one normalized description of the architecture.

Only this module knows HF config key names and their per-family defaults. Families are looked up
by the `architectures` entry in a table (never by substring of a model name). Anything the
Megatron build would silently get wrong (an activation other than SiLU, RoPE scaling, sliding
windows, output-projection biases, router noise) is refused with the key, its value and the
reason, before any model is built.

Both spellings transformers has used are accepted: `rope_theta` (4.x) and `rope_parameters`
(5.x); `num_experts` (Qwen3-MoE on the hub), `num_local_experts` (Mixtral, transformers 5) and
`n_routed_experts` (DeepSeek-V3, GLM-4.5); `rope_scaling` and `rope_parameters` for YaRN.

DeepSeek-V3 (also R1, Kimi-K2: the same `DeepseekV3ForCausalLM`) and GLM-4.5 (`Glm4MoeForCausalLM`)
add multi-latent attention (`mla`), YaRN (`yarn`), partial rotary, shared experts and sigmoid
routing with a score-correction bias and group-limited top-k. Their published checkpoints carry
multi-token-prediction layers (`num_mtp_layers`, skipped on import) and may be block-wise FP8
(`fp8_block`, dequantized on import).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from megatron_rl.errors import ConfigError


@dataclass(frozen=True)
class Family:
    name: str
    moe: bool
    qkv_bias: bool | None  # True/False fixed by the family; None: read `attention_bias`
    qk_norm: bool
    norm_topk_default: bool | None  # None: the family always renormalizes the top-k weights
    router: str = "softmax"  # "sigmoid": DeepSeek-V3-style scores, correction bias, groups, scaling
    mla: bool = False  # multi-latent attention (DeepSeek-V3)
    # `attention_bias` also biases o_proj (Llama, Qwen3), which Megatron's bias-free linears lack.
    attention_bias_on_o_proj: bool = True
    # Whether rollout engines honour `tie_word_embeddings` for this family. vLLM builds DeepSeek-V3
    # and GLM-4.5 with a separate lm_head whatever the config says (transformers would tie), so a
    # tied checkpoint of these would be two different models in the trainer and the engine.
    engines_tie: bool = True


FAMILIES: dict[str, Family] = {
    "Qwen3MoeForCausalLM": Family("qwen3_moe", moe=True, qkv_bias=None, qk_norm=True, norm_topk_default=False),
    "Qwen3ForCausalLM": Family("qwen3", moe=False, qkv_bias=None, qk_norm=True, norm_topk_default=None),
    "Qwen2ForCausalLM": Family("qwen2", moe=False, qkv_bias=True, qk_norm=False, norm_topk_default=None),
    "LlamaForCausalLM": Family("llama", moe=False, qkv_bias=None, qk_norm=False, norm_topk_default=None),
    "MixtralForCausalLM": Family("mixtral", moe=True, qkv_bias=False, qk_norm=False, norm_topk_default=None),
    "DeepseekV3ForCausalLM": Family("deepseek_v3", moe=True, qkv_bias=False, qk_norm=False, norm_topk_default=True,
                                    router="sigmoid", mla=True, engines_tie=False),
    # GLM-4.5 biases q/k/v (not o_proj) when attention_bias is set; qk-norm only with use_qk_norm.
    "Glm4MoeForCausalLM": Family("glm4_moe", moe=True, qkv_bias=None, qk_norm=False, norm_topk_default=True,
                                 router="sigmoid", attention_bias_on_o_proj=False, engines_tie=False),
}

PRESETS = ("tiny-qwen3-moe", "tiny-qwen3", "tiny-llama", "tiny-deepseek-v3", "tiny-glm4-moe",
           # the published models' config.json (architecture only: no weights, no tokenizer)
           "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "glm-4.5", "kimi-k2")


@dataclass(frozen=True)
class MLASpec:
    """Multi-latent attention geometry (DeepSeek-V2/V3 names)."""

    q_lora_rank: int | None  # None: one q_proj instead of q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class YarnSpec:
    """YaRN RoPE scaling, with the attention factor split the way Megatron-Core takes it:
    cos/sin are scaled by get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim), and
    MLA's softmax scale by get_mscale(factor, mscale_all_dim)**2."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float


@dataclass(frozen=True)
class ArchitectureSpec:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    ffn_hidden_size: int  # dense MLP width (dense models, and dense layers of MoE models)
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    initializer_range: float
    attention_dropout: float
    num_experts: int | None = None
    moe_top_k: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_norm_topk_prob: bool = True
    # One entry per layer: True where the layer is MoE. Empty for dense models.
    moe_layer_pattern: tuple[bool, ...] = ()
    moe_router_score: str = "softmax"  # or "sigmoid"
    moe_expert_bias: bool = False  # the router carries e_score_correction_bias (sigmoid families)
    moe_num_groups: int | None = None  # group-limited routing (n_group > 1)
    moe_group_topk: int | None = None
    moe_routed_scaling_factor: float | None = None
    moe_shared_ffn_hidden_size: int | None = None  # shared experts, fused into one MLP
    rotary_percent: float = 1.0  # partial rotary (GLM-4.5: 0.5)
    mla: MLASpec | None = None
    yarn: YarnSpec | None = None
    num_mtp_layers: int = 0  # multi-token-prediction layers in the checkpoint (not built)
    fp8_block: tuple[int, int] | None = None  # the checkpoint is block-wise e4m3 with these blocks

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)


def load_hf_config(source: str | Path, key: str = "model.hf_config") -> tuple[dict[str, Any], str]:
    """Return (raw config dict, where it came from) for a preset name, a file or a directory.
    `key`: what the user set it with, for the error (a command's flag, e.g. --hf-dir)."""
    name = str(source)
    if name in PRESETS:
        text = resources.files("megatron_rl.model.presets").joinpath(f"{name}.json").read_text()
        return json.loads(text), f"preset {name}"
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"{key}: {source} is neither a preset ({', '.join(PRESETS)}) "
            "nor a config.json file or a directory holding one"
        )
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: not JSON, or not UTF-8
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(raw, dict):  # every reader takes its keys
        raise ConfigError(f"{path}: expected a JSON object (a Hugging Face config.json), got {type(raw).__name__}")
    return raw, str(path)


# The numeric keys a config.json may hold, by the kind of value they must have (when present and
# not null): anything else is refused by name before any arithmetic on them.
POSITIVE_INT_KEYS = (
    "hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size", "head_dim",
    "num_key_value_heads", "max_position_embeddings", "num_experts", "num_local_experts", "n_routed_experts",
    "num_experts_per_tok", "moe_intermediate_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim", "q_lora_rank", "n_group", "topk_group", "decoder_sparse_step", "original_max_position_embeddings",
    "sliding_window",
)
NON_NEGATIVE_INT_KEYS = ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers")
REAL_KEYS = ("rms_norm_eps", "initializer_range", "attention_dropout", "routed_scaling_factor", "rope_theta",
             "partial_rotary_factor", "factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
# The largest value each integer key may have. Layers, experts and positions are counted out one by
# one (a tuple per layer, a loop per divisor), and widths multiply into parameter counts: a value
# beyond these is a typo or a damaged file, and refusing it costs nothing, while reading on took
# minutes and gigabytes (num_hidden_layers: 1e30 in `megatron-rl plan`). Each is 16x or more the
# largest published model's (DeepSeek-V3: 61 layers, 256 experts, hidden 7168, vocabulary 129280;
# Llama 4 Scout: 10M positions).
INT_KEY_LIMITS = {
    "num_hidden_layers": 1 << 12, "first_k_dense_replace": 1 << 12, "decoder_sparse_step": 1 << 12,
    "num_nextn_predict_layers": 1 << 12,
    "hidden_size": 1 << 18, "intermediate_size": 1 << 20, "moe_intermediate_size": 1 << 20, "head_dim": 1 << 14,
    "kv_lora_rank": 1 << 16, "q_lora_rank": 1 << 16, "qk_nope_head_dim": 1 << 14, "qk_rope_head_dim": 1 << 14,
    "v_head_dim": 1 << 14,
    "num_attention_heads": 1 << 14, "num_key_value_heads": 1 << 14,
    "vocab_size": 1 << 24,
    "max_position_embeddings": 1 << 28, "original_max_position_embeddings": 1 << 28, "sliding_window": 1 << 28,
    "num_experts": 1 << 16, "num_local_experts": 1 << 16, "n_routed_experts": 1 << 16, "num_experts_per_tok": 1 << 16,
    "n_shared_experts": 1 << 10, "n_group": 1 << 16, "topk_group": 1 << 16,
}
# Flags read as booleans: a string "false" would read as true (bool("false")).
BOOL_KEYS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "norm_topk_prob", "use_qk_norm",
             "use_sliding_window", "rope_interleave")


def check_value_types(raw: dict[str, Any], where: str) -> None:
    """ConfigError naming the first numeric or flag key (top level, or in rope_scaling /
    rope_parameters) whose value is not of its kind: a string, a bool, a fraction where a count
    belongs, NaN, a count beyond INT_KEY_LIMITS."""
    sections = [("", raw), *((f"{name}.", raw[name]) for name in ("rope_scaling", "rope_parameters")
                            if isinstance(raw.get(name), dict))]
    for prefix, section in sections:
        for key, value in section.items():
            if value is None:
                continue
            if key in POSITIVE_INT_KEYS or key in NON_NEGATIVE_INT_KEYS:
                least = 1 if key in POSITIVE_INT_KEYS else 0
                if isinstance(value, bool) or not isinstance(value, int) or value < least:
                    kind = "a positive integer" if least else "an integer >= 0"
                    raise ConfigError(f"{where}: {prefix}{key}={value!r} must be {kind}")
                limit = INT_KEY_LIMITS[key]
                if value > limit:
                    raise ConfigError(f"{where}: {prefix}{key}={value} is beyond {limit}, the most it is read with "
                                      f"(16x or more the largest published model's): a typo or a damaged file")
            elif key in REAL_KEYS:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ConfigError(f"{where}: {prefix}{key}={value!r} must be a finite number")
            elif key in BOOL_KEYS and not prefix and not isinstance(value, bool):
                raise ConfigError(f"{where}: {key}={value!r} must be true or false")


def parse_hf_config(raw: dict[str, Any], where: str = "config.json") -> ArchitectureSpec:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object (a Hugging Face config.json), got {type(raw).__name__}")
    check_value_types(raw, where)
    architectures = raw.get("architectures") or []
    supported = ", ".join(FAMILIES)
    if len(architectures) != 1:
        raise ConfigError(f"{where}: 'architectures' must name exactly one of: {supported}; got {architectures!r}")
    architecture = architectures[0]
    if architecture not in FAMILIES:
        raise ConfigError(f"{where}: architecture {architecture!r} is not supported; supported: {supported}")
    family = FAMILIES[architecture]

    def get(key: str, default: Any = ...) -> Any:
        if key in raw and raw[key] is not None:
            return raw[key]
        if default is ...:
            raise ConfigError(f"{where}: required key '{key}' is missing")
        return default

    def refuse(key: str, value: Any, why: str) -> None:
        raise ConfigError(f"{where}: {key}={value!r} is not supported ({why})")

    if get("hidden_act", "silu") != "silu":
        refuse("hidden_act", raw["hidden_act"], "only SwiGLU with SiLU is built")
    rope_theta, rope_type = _rope(raw)
    yarn = None
    if rope_type == "yarn" and family.mla:
        yarn = _yarn(_rope_parameters(raw), get("max_position_embeddings", 4096), refuse)
    elif rope_type not in ("default", None):
        why = ("only YaRN with multi-latent attention (DeepSeek-V3) is built" if rope_type == "yarn"
               else "this RoPE scaling is not implemented; use an unscaled checkpoint")
        refuse("rope_scaling/rope_parameters.rope_type", rope_type, why)
    if raw.get("use_sliding_window") or (
        family.name == "mixtral" and raw.get("sliding_window") is not None
        and raw["sliding_window"] < get("max_position_embeddings", 1 << 30)
    ):
        refuse("sliding_window", raw.get("sliding_window"), "sliding-window attention is not implemented")
    if raw.get("mlp_bias"):
        refuse("mlp_bias", True, "the MLP linears are built without bias")
    if family.qkv_bias is None and family.attention_bias_on_o_proj and raw.get("attention_bias"):
        # Llama and Qwen3 put this bias on o_proj as well, which Megatron's bias-free linears lack.
        refuse("attention_bias", True, "this family also biases o_proj, which is not built")
    if raw.get("tie_word_embeddings") and not family.engines_tie:
        refuse("tie_word_embeddings", True, f"rollout engines build {architecture} with a separate lm_head, so "
               "the trainer and the engine would run different models; its released checkpoints are untied: "
               "set it to false and store lm_head.weight")
    if raw.get("router_jitter_noise"):
        refuse("router_jitter_noise", raw["router_jitter_noise"], "router noise makes logprobs non-deterministic")

    hidden = get("hidden_size")
    heads = get("num_attention_heads")
    num_layers = get("num_hidden_layers")
    head_dim = get("head_dim", hidden // heads)
    mla = _mla(raw, get, refuse) if family.mla else None
    if mla is not None:
        head_dim = mla.qk_head_dim
    spec = dict(
        architecture=architecture,
        family=family.name,
        vocab_size=get("vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=get("num_key_value_heads", heads),
        head_dim=head_dim,
        ffn_hidden_size=get("intermediate_size"),
        rope_theta=float(rope_theta),
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        qkv_bias=family.qkv_bias if family.qkv_bias is not None else bool(get("attention_bias", False)),
        qk_norm=family.qk_norm or bool(family.name == "glm4_moe" and get("use_qk_norm", False)),
        max_position_embeddings=get("max_position_embeddings", 4096),
        initializer_range=float(get("initializer_range", 0.02)),
        attention_dropout=float(get("attention_dropout", 0.0)),
        rotary_percent=_rotary_percent(raw),
        mla=mla,
        yarn=yarn,
        num_mtp_layers=int(get("num_nextn_predict_layers", 0)),
        fp8_block=_fp8_block(raw, refuse),
    )
    if mla is not None:
        spec["num_key_value_heads"] = heads  # MLA has one key/value head per query head
    if heads % spec["num_key_value_heads"]:
        refuse("num_key_value_heads", spec["num_key_value_heads"], f"must divide num_attention_heads={heads}")
    if family.moe:
        num_experts = raw.get("num_experts") or raw.get("num_local_experts") or raw.get("n_routed_experts")
        if not num_experts:
            raise ConfigError(f"{where}: an MoE architecture needs 'num_experts', 'num_local_experts' or 'n_routed_experts'")
        spec.update(
            num_experts=int(num_experts),
            moe_top_k=int(get("num_experts_per_tok")),
            moe_ffn_hidden_size=int(get("moe_intermediate_size", spec["ffn_hidden_size"])),
            moe_norm_topk_prob=True if family.norm_topk_default is None else bool(get("norm_topk_prob", family.norm_topk_default)),
            moe_layer_pattern=_moe_layers(raw, num_layers, family, where),
        )
        if spec["moe_top_k"] > spec["num_experts"]:
            refuse("num_experts_per_tok", spec["moe_top_k"], f"more than the {num_experts} experts")
        if family.router == "sigmoid":
            spec.update(_sigmoid_router(raw, get, refuse, spec))
    return ArchitectureSpec(**spec)


def with_implied_keys(raw: dict[str, Any], arch: ArchitectureSpec) -> dict[str, Any]:
    """config.json with the keys transformers implies but rollout engines read explicitly.

    transformers' DeepseekV3Config always routes with sigmoid scores and the correction bias and
    writes neither `topk_method` nor `scoring_func`; vLLM's DeepSeek model reads both (measured:
    without `topk_method: noaux_tc` it fails to load `e_score_correction_bias`; from its code, a
    missing `scoring_func` means softmax routing). Written into every HF directory we export."""
    if arch.family != "deepseek_v3":
        return dict(raw)
    return {"topk_method": "noaux_tc", "scoring_func": "sigmoid", **raw}


def _sigmoid_router(raw: dict[str, Any], get, refuse, spec: dict) -> dict[str, Any]:
    """DeepSeek-V3 / GLM-4.5 routing: sigmoid scores, a correction bias added for the choice only,
    group-limited top-k, renormalized weights times routed_scaling_factor, shared experts."""
    experts, top_k = spec["num_experts"], spec["moe_top_k"]
    if not spec["moe_norm_topk_prob"] and top_k > 1:
        # Megatron-Core renormalizes sigmoid top-k weights whenever k > 1.
        refuse("norm_topk_prob", False, "sigmoid routing is built with renormalized top-k weights only")
    if get("topk_method", "noaux_tc") != "noaux_tc":
        refuse("topk_method", raw["topk_method"], "only noaux_tc (sigmoid scores with correction bias) is built")
    if get("scoring_func", "sigmoid") != "sigmoid":
        refuse("scoring_func", raw["scoring_func"], "these families are built with sigmoid router scores")
    groups, group_topk = int(get("n_group", 1)), int(get("topk_group", 1))
    if groups > 1:
        if experts % groups:
            refuse("n_group", groups, f"must divide the {experts} routed experts")
        if not 1 <= group_topk <= groups:
            refuse("topk_group", group_topk, f"must be between 1 and n_group={groups}")
        if experts // groups < 2:
            refuse("n_group", groups, "each group needs at least 2 experts (groups are ranked by their top-2 scores)")
        if top_k > group_topk * (experts // groups):
            refuse("num_experts_per_tok", top_k, f"more than the {group_topk * (experts // groups)} experts "
                   f"in the topk_group={group_topk} chosen groups")
    shared = int(get("n_shared_experts", 0) or 0)
    return dict(
        moe_router_score="sigmoid",
        moe_expert_bias=True,
        moe_num_groups=groups if groups > 1 else None,
        moe_group_topk=group_topk if groups > 1 else None,
        moe_routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
        moe_shared_ffn_hidden_size=shared * spec["moe_ffn_hidden_size"] if shared else None,
        moe_layer_pattern=tuple(i >= int(get("first_k_dense_replace", 0)) for i in range(spec["num_layers"])),
    )


def _mla(raw: dict[str, Any], get, refuse) -> MLASpec:
    if raw.get("attention_bias"):
        refuse("attention_bias", True, "multi-latent attention is built without projection biases")
    if not get("rope_interleave", True):
        # Megatron-Core's MLA always reads the rotary half of q/k in interleaved pairs, as the
        # published DeepSeek checkpoints store it.
        refuse("rope_interleave", False, "multi-latent attention is built for interleaved rotary weights only")
    q_lora_rank = raw.get("q_lora_rank")
    return MLASpec(
        q_lora_rank=int(q_lora_rank) if q_lora_rank else None,
        kv_lora_rank=int(get("kv_lora_rank")),
        qk_nope_head_dim=int(get("qk_nope_head_dim")),
        qk_rope_head_dim=int(get("qk_rope_head_dim")),
        v_head_dim=int(get("v_head_dim")),
    )


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    params = raw.get("rope_parameters")
    return params if isinstance(params, dict) else (raw.get("rope_scaling") or {})


def _yarn(params: dict[str, Any], max_positions: int, refuse) -> YarnSpec:
    """HF's YaRN attention factor, expressed in Megatron-Core's two mscale terms (see YarnSpec)."""
    factor = float(params.get("factor", 1.0))
    if factor <= 1.0:
        refuse("rope_scaling.factor", factor, "YaRN needs a factor above 1")
    if params.get("attention_factor") is not None:
        refuse("rope_scaling.attention_factor", params["attention_factor"], "an explicit YaRN attention factor is not built")
    if params.get("truncate") is False:
        refuse("rope_scaling.truncate", False, "YaRN is built with truncated correction bounds (the DeepSeek rule)")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        megatron_mscale, megatron_all_dim = float(mscale), float(mscale_all_dim)
    else:
        # HF then scales cos/sin by get_mscale(factor) = 0.1 ln(factor) + 1, while the softmax
        # scale still uses mscale_all_dim (0 if absent). Megatron divides the first by
        # get_mscale(factor, mscale_all_dim): choose its mscale so the quotient is HF's factor.
        megatron_all_dim = float(mscale_all_dim or 0.0)
        log = math.log(factor)
        target = (0.1 * log + 1.0) * (0.1 * megatron_all_dim * log + 1.0)
        megatron_mscale = (target - 1.0) / (0.1 * log)
    return YarnSpec(
        factor=factor,
        original_max_position_embeddings=int(params.get("original_max_position_embeddings") or max_positions),
        beta_fast=float(params.get("beta_fast", 32.0)),
        beta_slow=float(params.get("beta_slow", 1.0)),
        mscale=megatron_mscale,
        mscale_all_dim=megatron_all_dim,
    )


def _rotary_percent(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    value = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    return float(value if value is not None else 1.0)


def _fp8_block(raw: dict[str, Any], refuse) -> tuple[int, int] | None:
    """Block size of a block-wise FP8 checkpoint (DeepSeek-V3's published format), else None."""
    quant = raw.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        refuse("quantization_config", quant, "it must be a mapping (quant_method, fmt, weight_block_size)")
    if quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
        refuse("quantization_config", {k: quant.get(k) for k in ("quant_method", "fmt")},
               "only block-wise e4m3 FP8 checkpoints are dequantized on import; use a BF16 checkpoint")
    block = quant.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2):
        refuse("quantization_config.weight_block_size", block, "per-tensor FP8 is not read; a [rows, cols] block size is")
    if not all(isinstance(size, int) and not isinstance(size, bool) and 1 <= size <= 1 << 16 for size in block):
        refuse("quantization_config.weight_block_size", block, "each block size must be an integer from 1 to 65536")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        refuse("quantization_config.activation_scheme", quant["activation_scheme"], "only dynamic activation scales are read")
    return int(block[0]), int(block[1])


def _rope(raw: dict[str, Any]) -> tuple[float, str | None]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        return params.get("rope_theta", raw.get("rope_theta", 10000.0)), params.get("rope_type", "default")
    scaling = raw.get("rope_scaling")
    rope_type = None if not scaling else scaling.get("rope_type", scaling.get("type"))
    return raw.get("rope_theta", 10000.0), rope_type


def _moe_layers(raw: dict[str, Any], num_layers: int, family: Family, where: str) -> tuple[bool, ...]:
    if family.name != "qwen3_moe":
        return (True,) * num_layers
    # Qwen3-MoE: layer i is sparse unless listed in mlp_only_layers, and only every
    # decoder_sparse_step-th layer is sparse.
    step = raw.get("decoder_sparse_step") or 1
    listed = raw.get("mlp_only_layers") or []
    if not isinstance(listed, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in listed):
        raise ConfigError(f"{where}: mlp_only_layers={listed!r} must be a list of layer ids (integers)")
    dense = set(listed)
    bad = [i for i in dense if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(f"{where}: mlp_only_layers has layer ids outside [0, {num_layers}): {bad}")
    return tuple((i not in dense) and (i + 1) % step == 0 for i in range(num_layers))
