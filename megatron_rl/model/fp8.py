"""FP8 training: our recipe names -> Megatron-Core's, and what each recipe needs of the machine.

    hardware = detect_hardware(device)                  # GPU, CUDA, Transformer Engine version
    check_fp8(config, arch, hardware, use_te=..., grouped_gemm=...)   # ConfigError, or nothing
    TransformerConfig(..., **transformer_config_fields(config.model))

Every check takes a `Hardware` description instead of reading the GPU itself, so the whole
matrix (recipe x compute capability x CUDA x TE version) is tested on a CPU machine.

Where the minimums come from:
- Megatron-Core 0.16.1 `fp8_utils.get_fp8_recipe`: builds Float8CurrentScaling ("tensorwise")
  only with TE >= 2.2.0.dev0, Float8BlockScaling ("blockwise") only with TE >= 2.3.0.dev0, and
  any recipe other than delayed scaling only with TE >= 2.1.0 (older TE asserts "delayed").
  `TransformerConfig.__post_init__`: MoE FP8 needs TE >= 1.7.0, FP8 grouped GEMM TE >= 1.11.0;
  keeping first/last layers in BF16 is refused with delayed scaling.
- Transformer Engine's own availability checks (`check_fp8_support` and friends): FP8 needs
  compute capability 8.9 (Ada, with CUDA >= 12.1) or 9.0+; block scaling needs 9.0+ and CUDA
  >= 12.9; MXFP8 needs 10.0+ and is not supported on 12.0+ yet. Releases differ in details
  (early block-scaling releases were Hopper-only), so when TE is installed its own verdict for
  the recipe is asked as well: a recipe passes only if both this table and TE allow it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass, field

import torch
from packaging.version import InvalidVersion, Version

from megatron_rl.config import ModelConfig, RunConfig

from megatron_rl.errors import ConfigError


@dataclass(frozen=True)
class RecipeNeeds:
    megatron: str  # TransformerConfig.fp8_recipe
    # TransformerConfig.fp8: TE's default format per recipe. "hybrid" = E4M3 forward, E5M2 for
    # gradients (wider range); block-scaled recipes keep E4M3 everywhere, their scales give range.
    fp8_format: str
    min_capability: tuple[int, int]
    below_capability: tuple[int, int] | None  # first capability that is NOT supported
    min_cuda: str | None
    min_te: str
    gpus: str  # the same requirement in words, for messages
    # Megatron's get_fp8_align_size: FP8 GEMM dimensions (and token counts) must be multiples.
    align: int = 16


RECIPES: dict[str, RecipeNeeds] = {
    "delayed": RecipeNeeds("delayed", "hybrid", (8, 9), None, None, "1.7.0.dev0", ">= 8.9 (Ada, Hopper or newer)"),
    "current": RecipeNeeds("tensorwise", "hybrid", (8, 9), None, None, "2.2.0.dev0", ">= 8.9 (Ada, Hopper or newer)"),
    "blockwise": RecipeNeeds("blockwise", "e4m3", (9, 0), None, "12.9", "2.3.0.dev0", ">= 9.0 (Hopper or newer)"),
    "mxfp8": RecipeNeeds("mxfp8", "e4m3", (10, 0), (12, 0), None, "2.1.0", "10.x or 11.x (Blackwell)", align=32),
}
GROUPED_GEMM_MIN_TE = "1.11.0"  # FP8 with TE's grouped GEMM experts (Megatron-Core's check)
ADA_MIN_CUDA = "12.1"  # FP8 on compute capability 8.9 (TE's check)


@dataclass(frozen=True)
class Hardware:
    """What the FP8 checks need to know about the machine."""

    device_type: str  # "cuda" or "cpu"
    name: str = ""  # GPU name, for messages
    capability: tuple[int, int] | None = None
    cuda: str | None = None  # the CUDA version torch was built with
    te_version: str | None = None  # None: Transformer Engine is not installed
    # TE's own verdict per recipe name, (supported, reason), where TE could be asked.
    te_support: dict[str, tuple[bool, str]] = field(default_factory=dict)
    # APEX's fused_weight_gradient_mlp_cuda imports: Megatron-Core's own linears need it for
    # model.gradient_accumulation_fusion (model/throughput_levers.py).
    wgrad_accumulation_kernel: bool = False

    def describe(self) -> str:
        if self.device_type != "cuda":
            return self.device_type
        te = f"transformer-engine {self.te_version}" if self.te_version else "no transformer-engine"
        return f"{self.name or 'GPU'} (compute capability {_dotted(self.capability)}, CUDA {self.cuda}, {te})"


def transformer_engine_version() -> str | None:
    """The installed TE version, read from package metadata (no import), or None."""
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    for dist in ("transformer-engine", "transformer-engine-torch"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    import transformer_engine

    return getattr(transformer_engine, "__version__", None)


def detect_hardware(device: torch.device) -> Hardware:
    if device.type != "cuda" or not torch.cuda.is_available():
        return Hardware(device_type=device.type, te_version=transformer_engine_version())
    te_version = transformer_engine_version()
    return Hardware(
        device_type="cuda",
        name=torch.cuda.get_device_name(device),
        capability=tuple(torch.cuda.get_device_capability(device)),
        cuda=torch.version.cuda,
        te_version=te_version,
        te_support=_ask_transformer_engine() if te_version else {},
        wgrad_accumulation_kernel=importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None,
    )


def _ask_transformer_engine() -> dict[str, tuple[bool, str]]:
    """TE's own availability verdicts (method names have been stable since TE 2.x)."""
    try:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    except ImportError:
        try:
            from transformer_engine.pytorch.quantization import FP8GlobalStateManager
        except ImportError:
            return {}
    methods = {"delayed": "is_fp8_available", "current": "is_fp8_available",
               "blockwise": "is_fp8_block_scaling_available", "mxfp8": "is_mxfp8_available"}
    verdicts = {}
    for recipe, method in methods.items():
        check = getattr(FP8GlobalStateManager, method, None)
        if check is not None:
            supported, reason = check()
            verdicts[recipe] = (bool(supported), str(reason))
    return verdicts


def unmet_need(recipe: str, hardware: Hardware) -> str | None:
    """Why this machine cannot run the recipe (GPU, CUDA, TE version), or None if it can."""
    needs = RECIPES[recipe]
    if hardware.device_type != "cuda" or hardware.capability is None:
        return f"it needs a CUDA GPU of compute capability {needs.gpus}; this run uses {hardware.device_type}"
    if hardware.te_version is None:
        return "it needs the transformer-engine package (the 'gpu' extra), which is not installed"
    capability = hardware.capability
    if capability < needs.min_capability or (needs.below_capability and capability >= needs.below_capability):
        return f"it needs compute capability {needs.gpus}"
    if needs.min_cuda and older_version(hardware.cuda, needs.min_cuda):
        return f"it needs torch built with CUDA >= {needs.min_cuda}"
    if capability == (8, 9) and older_version(hardware.cuda, ADA_MIN_CUDA):
        return f"FP8 on compute capability 8.9 needs torch built with CUDA >= {ADA_MIN_CUDA}"
    if older_version(hardware.te_version, needs.min_te):
        return f"Megatron-Core builds this recipe only with transformer-engine >= {needs.min_te}"
    supported, reason = hardware.te_support.get(recipe, (True, ""))
    if not supported:
        return f"Transformer Engine reports it unsupported here: {reason}"
    return None


def supported_recipes(hardware: Hardware) -> list[str]:
    return [name for name in RECIPES if unmet_need(name, hardware) is None]


def check_recipe(model: ModelConfig, hardware: Hardware, use_te: bool) -> None:
    """The recipe against the machine: device, layer spec, precision, GPU, CUDA, TE version."""
    recipe = model.fp8_recipe
    if recipe is None:
        return
    if hardware.device_type != "cuda" or not use_te:
        raise ConfigError(
            f"model.fp8_recipe={recipe!r} needs Transformer Engine on a CUDA GPU (Hopper or newer); "
            f"this run uses {hardware.device_type} with the {'TE' if use_te else 'local'} layer spec. "
            "Remove fp8_recipe for CPU runs."
        )
    if model.precision != "bf16":
        raise ConfigError(f"model.fp8_recipe={recipe!r} requires model.precision: bf16 (got {model.precision})")
    problem = unmet_need(recipe, hardware)
    if problem:
        others = supported_recipes(hardware)
        instead = f"fp8_recipe values this machine supports: {', '.join(others)}" if others else \
            "this machine supports no FP8 recipe: remove model.fp8_recipe"
        raise ConfigError(f"model.fp8_recipe={recipe!r} cannot run on {hardware.describe()}: {problem}. {instead}")


def check_fp8(config: RunConfig, arch, hardware: Hardware, *, use_te: bool, grouped_gemm: bool) -> None:
    """Everything FP8 needs of this run: the machine, the model's shapes and the layout."""
    model = config.model
    check_recipe(model, hardware, use_te)
    if model.fp8_recipe is None:
        return
    needs = RECIPES[model.fp8_recipe]
    if arch.is_moe and grouped_gemm and older_version(hardware.te_version, GROUPED_GEMM_MIN_TE):
        raise ConfigError(
            f"model.fp8_recipe={model.fp8_recipe!r} with grouped-GEMM experts needs transformer-engine >= "
            f"{GROUPED_GEMM_MIN_TE} (installed: {hardware.te_version}); upgrade it or set model.moe_grouped_gemm: false"
        )
    parallel = config.parallel
    if model.fp8_param and not parallel.distributed_optimizer:
        # The FP8 weights have no room for updates: only the distributed optimizer keeps an fp32
        # master copy and re-quantizes it after each step (Megatron: fp8 param gather).
        raise ConfigError("model.fp8_param=true requires parallel.distributed_optimizer: true")
    per_stage = arch.num_layers // parallel.pp
    for key in ("fp8_bf16_first_layers", "fp8_bf16_last_layers"):
        if getattr(model, key) > per_stage:
            raise ConfigError(
                f"model.{key}={getattr(model, key)} exceeds the layers per pipeline stage ({per_stage} = "
                f"{arch.num_layers} layers / parallel.pp={parallel.pp}); Megatron-Core allows at most that"
            )
    if model.fp8_bf16_first_layers + model.fp8_bf16_last_layers >= arch.num_layers:
        raise ConfigError(
            f"model.fp8_bf16_first_layers + fp8_bf16_last_layers = "
            f"{model.fp8_bf16_first_layers + model.fp8_bf16_last_layers} keeps all {arch.num_layers} layers in "
            "BF16; remove model.fp8_recipe instead"
        )
    for what, size in _gemm_dims(arch, parallel):
        if size % needs.align:
            raise ConfigError(
                f"model.fp8_recipe={model.fp8_recipe!r}: FP8 GEMMs need every weight dimension to be a multiple "
                f"of {needs.align}, but {what} = {size}; train this model in BF16 or choose another layout"
            )


def _gemm_dims(arch, parallel) -> list[tuple[str, int]]:
    """Each linear layer's weight dimensions on one rank, named by where they come from."""
    tp, etp = parallel.tp, parallel.expert_tp
    dims = [
        ("hidden_size", arch.hidden_size),
        (f"num_attention_heads*head_dim/tp (tp={tp})", arch.num_attention_heads * arch.head_dim // tp),
        (f"num_key_value_heads*head_dim/tp (tp={tp})", arch.num_key_value_heads * arch.head_dim // tp),
    ]
    if not arch.is_moe or not all(arch.moe_layer_pattern):
        dims.append((f"intermediate_size/tp (tp={tp})", arch.ffn_hidden_size // tp))
    if arch.is_moe:
        dims.append((f"moe_intermediate_size/etp (etp={etp})", arch.moe_ffn_hidden_size // etp))
    return dims


def transformer_config_fields(model: ModelConfig) -> dict:
    """The TransformerConfig fields for this config's FP8 settings (empty without FP8)."""
    if model.fp8_recipe is None:
        return {}
    needs = RECIPES[model.fp8_recipe]
    fields = dict(fp8=needs.fp8_format, fp8_recipe=needs.megatron, fp8_param=model.fp8_param)
    if model.fp8_bf16_layers:
        fields.update(
            first_last_layers_bf16=True,
            num_layers_at_start_in_bf16=model.fp8_bf16_first_layers,
            num_layers_at_end_in_bf16=model.fp8_bf16_last_layers,
        )
    return fields


def micro_batch_multiple(model: ModelConfig, sequence_parallel_tp: int) -> int:
    """Packed micro-batch lengths must be a multiple of this.

    FP8 GEMMs take the tokens as rows, and with sequence parallelism TE quantizes each rank's
    shard (T / tp rows) before gathering it, so every shard must be aligned, not just the total.
    """
    align = RECIPES[model.fp8_recipe].align if model.fp8_recipe else 1
    return sequence_parallel_tp * align


def older_version(version: str | None, minimum: str) -> bool:
    """Whether `version` is below `minimum` (None, not installed: below)."""
    if version is None:
        return True
    try:
        return Version(version) < Version(minimum)
    except InvalidVersion:
        return False  # an unreadable local build: leave the verdict to TE itself


def _dotted(capability: tuple[int, int] | None) -> str:
    return "unknown" if capability is None else f"{capability[0]}.{capability[1]}"
