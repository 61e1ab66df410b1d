"""Read a Hugging Face `config.json` into one normalized description of the architecture.

Only this module knows HF config key names and their per-family defaults. Families are looked up
by the `architectures` entry in a table (never by substring of a model name). Anything the
Megatron build would silently get wrong (an activation other than SiLU, RoPE scaling, sliding
windows, output-projection biases, router noise) is refused with the key, its value and the
reason, before any model is built.

Both spellings transformers has used are accepted: `rope_theta` (4.x) and `rope_parameters`
(5.x); `num_experts` (Qwen3-MoE on the hub) and `num_local_experts` (Mixtral, transformers 5).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from megatron_rl.config import ConfigError


@dataclass(frozen=True)
class Family:
    name: str
    moe: bool
    qkv_bias: bool | None  # True/False fixed by the family; None: read `attention_bias`
    qk_norm: bool
    norm_topk_default: bool | None  # None: the family always renormalizes the top-k weights


FAMILIES: dict[str, Family] = {
    "Qwen3MoeForCausalLM": Family("qwen3_moe", moe=True, qkv_bias=None, qk_norm=True, norm_topk_default=False),
    "Qwen3ForCausalLM": Family("qwen3", moe=False, qkv_bias=None, qk_norm=True, norm_topk_default=None),
    "Qwen2ForCausalLM": Family("qwen2", moe=False, qkv_bias=True, qk_norm=False, norm_topk_default=None),
    "LlamaForCausalLM": Family("llama", moe=False, qkv_bias=None, qk_norm=False, norm_topk_default=None),
    "MixtralForCausalLM": Family("mixtral", moe=True, qkv_bias=False, qk_norm=False, norm_topk_default=None),
}

PRESETS = ("tiny-qwen3-moe", "tiny-qwen3", "tiny-llama")


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

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)


def load_hf_config(source: str | Path) -> tuple[dict[str, Any], str]:
    """Return (raw config dict, where it came from) for a preset name, a file or a directory."""
    name = str(source)
    if name in PRESETS:
        text = resources.files("megatron_rl.model.presets").joinpath(f"{name}.json").read_text()
        return json.loads(text), f"preset {name}"
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"model.hf_config: {source} is neither a preset ({', '.join(PRESETS)}) "
            "nor a config.json file or a directory holding one"
        )
    try:
        return json.loads(path.read_text()), str(path)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from exc


def parse_hf_config(raw: dict[str, Any], where: str = "config.json") -> ArchitectureSpec:
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
    if rope_type not in ("default", None):
        refuse("rope_scaling/rope_parameters.rope_type", rope_type, "RoPE scaling is not implemented; use an unscaled checkpoint")
    if raw.get("use_sliding_window") or (
        family.name == "mixtral" and raw.get("sliding_window") is not None
        and raw["sliding_window"] < get("max_position_embeddings", 1 << 30)
    ):
        refuse("sliding_window", raw.get("sliding_window"), "sliding-window attention is not implemented")
    if raw.get("mlp_bias"):
        refuse("mlp_bias", True, "the MLP linears are built without bias")
    if family.qkv_bias is None and raw.get("attention_bias"):
        # Llama and Qwen3 put this bias on o_proj as well, which Megatron's bias-free linears lack.
        refuse("attention_bias", True, "this family also biases o_proj, which is not built")
    if raw.get("router_jitter_noise"):
        refuse("router_jitter_noise", raw["router_jitter_noise"], "router noise makes logprobs non-deterministic")

    hidden = get("hidden_size")
    heads = get("num_attention_heads")
    num_layers = get("num_hidden_layers")
    head_dim = get("head_dim", hidden // heads)
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
        qk_norm=family.qk_norm,
        max_position_embeddings=get("max_position_embeddings", 4096),
        initializer_range=float(get("initializer_range", 0.02)),
        attention_dropout=float(get("attention_dropout", 0.0)),
    )
    if heads % spec["num_key_value_heads"]:
        refuse("num_key_value_heads", spec["num_key_value_heads"], f"must divide num_attention_heads={heads}")
    if family.moe:
        num_experts = raw.get("num_experts") or raw.get("num_local_experts")
        if not num_experts:
            raise ConfigError(f"{where}: an MoE architecture needs 'num_experts' or 'num_local_experts'")
        spec.update(
            num_experts=int(num_experts),
            moe_top_k=int(get("num_experts_per_tok")),
            moe_ffn_hidden_size=int(get("moe_intermediate_size", spec["ffn_hidden_size"])),
            moe_norm_topk_prob=True if family.norm_topk_default is None else bool(get("norm_topk_prob", family.norm_topk_default)),
            moe_layer_pattern=_moe_layers(raw, num_layers, family, where),
        )
        if spec["moe_top_k"] > spec["num_experts"]:
            refuse("num_experts_per_tok", spec["moe_top_k"], f"more than the {num_experts} experts")
    return ArchitectureSpec(**spec)


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
    dense = set(raw.get("mlp_only_layers") or [])
    bad = [i for i in dense if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(f"{where}: mlp_only_layers has layer ids outside [0, {num_layers}): {bad}")
    return tuple((i not in dense) and (i + 1) % step == 0 for i in range(num_layers))
