"""A PEFT LoRA adapter read as Megatron's adapters: the inverse of bridge/peft_export.py.

    adapter = read_peft_adapter(adapter_dir, arch, base_shapes(hf_dir))  # everything checked, nothing built
    adapter.adapters       # {Megatron weight name: (A, B)}, whole, B's rows fused like W's
    adapter.lora           # the model.lora it implies: rank, alpha, dropout, targets
    AdapterValues(module, adapter.adapters, weights)   # the checkpoint writer's values, adapters included

The names are the export's (`peft_table`, inverted here). Megatron fuses q/k/v into linear_qkv and
gate/up into linear_fc1 (per expert too) with one A shared by the fused outputs, so the import
takes PEFT's per-projection adapters back only where their A matrices are equal (as in every
export of this project): B's pieces are fused like W's and A is taken once. Adapters whose A
matrices differ have no form at the same rank and are refused, naming the module and the largest
difference (never averaged).

Everything is checked before anything is built or written, and refused by name (the file, the key
and its value, and what to do). adapter_config.json key by key: every field of peft's LoraConfig
is honoured (r, lora_alpha, lora_dropout, target_modules checked against the tensors, ...),
metadata with no effect on the model (revision, inference_mode, ...), or refused unless at its
default: the settings that change the forward beyond W + (lora_alpha / r) B A on the modules the
tensors name (rsLoRA, DoRA, modules_to_save, per-module ranks or alphas, trained biases,
layers_to_transform, exclude_modules, an initialization that changes the base weights, ...); a
key of none of these kinds is refused too. Every tensor of adapter_model.safetensors is consumed
or refused (an unknown key, a module this model lacks, a shape that does not fit the base, an A
without its B, a fused module with a piece missing, a target covering only some of its layers or
experts); a pickled adapter_model.bin is never loaded. Adapters on transformers 5's fused expert
parameters (`target_parameters`) are refused: the names read are the per-expert modules the export
writes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from megatron_rl.bridge.importer import checkpoint_index, non_finite, open_safetensors
from megatron_rl.bridge.layouts import merge, split
from megatron_rl.bridge.peft_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PREFIX, TARGET_WEIGHTS, lora_target, \
    peft_table
from megatron_rl.bridge.placement import placements
from megatron_rl.bridge.streamed import storage_key, view_like
from megatron_rl.config.model import LoraConfig
from megatron_rl.errors import ConfigError
from megatron_rl.model.hf_config import ArchitectureSpec

PICKLED_WEIGHTS = "adapter_model.bin"
MERGE_INSTEAD = ("merge the adapter into its base instead (peft's merge_and_unload, then save_pretrained) and convert "
                 "that with `megatron-rl convert hf-to-megatron`")
# adapter_config.json, key by key: every field of peft's LoraConfig (0.21; PeftConfig's too) is in
# exactly one of the tables below, and a key in none of them is refused by name (a newer peft's
# setting may change the model, and peft itself ignores keys it does not know, with a warning, so
# an adapter of a LoRA variant would load as plain LoRA). tests/bridge/test_peft_import.py checks
# the installed peft's LoraConfig against them.
#
# Read and honoured: they make the import (the adapters' names, rank and scale are checked against
# the tensors; init_lora_weights below; base_model_name_or_path against --hf: tools/convert_lora.py).
HONOURED = ("peft_type", "r", "lora_alpha", "lora_dropout", "target_modules", "init_lora_weights",
            "base_model_name_or_path")
# No effect on the forward of the model peft builds from the adapter: read by nobody here.
METADATA = {
    "task_type": "peft's model class for the task; a task's own head is in modules_to_save (refused)",
    "revision": "the base's revision on the Hugging Face Hub",
    "inference_mode": "whether peft loads the adapters frozen",
    "auto_mapping": "the base model's class, for AutoPeftModel",
    "peft_version": "the peft that wrote the adapter",
    "megatron_config": "peft's own Megatron parallel layers, which a Hugging Face model has not",
    "megatron_core": "peft's own Megatron parallel layers, which a Hugging Face model has not",
    "runtime_config": "runtime offloading",
    "loftq_config": "read by peft only with init_lora_weights=loftq (refused)",
    "eva_config": "EVA's initialization of lora_A, which the file's tensors replace",
    "corda_config": "read by peft only with init_lora_weights=corda (refused)",
    "lora_ga_config": "read by peft only with init_lora_weights=lora_ga (refused)",
    "qalora_group_size": "read by peft only with use_qalora (refused)",
    "ensure_weight_tying": "ties adapters of tied embedding and output layers, which no imported adapter is on",
}
# Refused unless they are at peft's default (None, false, empty, but NONE_ONLY; `bias` "none"; a
# rank_pattern or alpha_pattern whose every value is r or lora_alpha): each changes the model beyond
# W + (lora_alpha / r) B A on the modules the tensors name, or puts adapters where model.lora has none.
UNREPRESENTABLE = {
    "use_rslora": "scales the adapters by lora_alpha / sqrt(r), model.lora by alpha / rank",
    "use_dora": "adds DoRA's trained magnitude per output, which model.lora has not",
    "modules_to_save": "trains whole copies of these modules beside the adapters",
    "rank_pattern": "gives some modules a rank of their own; model.lora has one rank",
    "alpha_pattern": "gives some modules an alpha of their own; model.lora has one alpha",
    "lora_bias": "trains a bias beside lora_B",
    "bias": "trains the base's biases beside the adapters",
    "fan_in_fan_out": "stores the adapters transposed (Conv1D layers), which no family here has",
    "layers_to_transform": "puts the adapters on these layers only (peft ignores the file's tensors of every other "
                           "layer), while a model.lora target adapts every layer",
    "layers_pattern": "names the layer list that layers_to_transform counts in",
    "exclude_modules": "keeps the adapters off these modules (peft ignores their tensors in the file)",
    "target_parameters": "adapts parameters directly (transformers 5's fused expert tensors); the import reads the "
                         "per-expert modules (target_modules) that transformers < 5 and this project's export name",
    "layer_replication": "builds the model with replicated layers",
    "trainable_token_indices": "trains rows of the embedding",
    "alora_invocation_tokens": "activates the adapters only after its invocation tokens (aLoRA)",
    "use_qalora": "pools the adapters' input for a quantized base (QALoRA)",
    "use_bdlora": "shares block-diagonal adapters over tensor-parallel shards (BD-LoRA)",
    "arrow_config": "routes between several adapters (Arrow)",
    "velora_config": "is the VeLoRA variant of LoRA, not checked to load as plain LoRA",
    "monteclora_config": "samples the adapters (MonteCLoRA), a variant of LoRA",
    "kasa_config": "truncates the base weights' singular values and scales the adapters by trained ones (KaSA)",
}
# Set at all (not None), these act even when empty: peft turns a variant's {} into its config with
# the defaults, and trains the listed tokens of [] (an empty selection, not "off").
NONE_ONLY = ("use_bdlora", "arrow_config", "velora_config", "monteclora_config", "kasa_config",
             "trainable_token_indices")
# init_lora_weights: how peft starts the adapters it builds when it loads the adapter (the file's
# tensors then replace them). True, "gaussian" and "eva" start lora_B at 0, so a module peft adapts
# without a tensor in the file stays the base's; False and "orthogonal" start it nonzero, harmless
# only where every module peft adapts has its tensors in the file (checked: _check_targets).
# These change the base weights when peft builds the adapter (the base minus the initial adapter;
# LoftQ quantizes it) or make the adapter a variant: peft's model is then not the base's W + s B A.
BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga", "mica")


def init_kind(init) -> str | None:
    """"zero" (lora_B starts at 0), "random" (it does not), or None (refused) for init_lora_weights."""
    if init is True or init in ("gaussian", "eva"):
        return "zero"
    if init is False or init == "orthogonal":
        return "random"
    return None


@dataclass
class PeftAdapter:
    adapters: dict[str, tuple[torch.Tensor, torch.Tensor]]  # Megatron weight name -> (A, B), whole
    rank: int
    alpha: float
    dropout: float
    targets: list[str]  # model.lora targets, in config/model.py's order
    named_base: str | None = None  # adapter_config.json's base_model_name_or_path: the base it was trained on

    @property
    def lora(self) -> dict:
        """The model.lora this adapter implies (what the checkpoint records, megatron_rl.json `lora`)."""
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": self.targets}


def base_shapes(hf_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: shape} of the base model, from the safetensors headers (no weight is read)."""
    shapes = {}
    for name, file in checkpoint_index(hf_dir).items():
        with open_safetensors(file) as handle:
            shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def read_peft_adapter(directory: str | Path, arch: ArchitectureSpec, shapes: dict[str, tuple[int, ...]]) -> PeftAdapter:
    """The adapter in `directory` as Megatron's adapters for `arch`, checked against the base's
    tensor shapes (`base_shapes`). Raises ConfigError naming what cannot be imported."""
    directory = Path(directory)
    config = read_adapter_config(directory)
    rank, alpha = config["r"], float(config["lora_alpha"])
    modules = _module_tensors(directory, arch, shapes, rank)
    table = peft_table(arch)
    adapters = {}
    for name, (names, layout) in table.items():
        found = [module for module in names if module in modules]
        if not found:
            continue
        if len(found) < len(names):
            missing = next(module for module in names if module not in modules)
            raise ConfigError(f"{directory}: the adapter has {_short(found[0])} but not {_short(missing)}: Megatron fuses "
                              f"{', '.join(_leaf(m) for m in names)} into one adapter ({name}); train the adapter on all "
                              f"of them, or {MERGE_INSTEAD}")
        a = modules[names[0]][0]
        for module in names[1:]:
            difference = (modules[module][0].double() - a.double()).abs().max().item()
            if difference != 0:
                raise ConfigError(
                    f"{directory}: the lora_A of {_short(module)} differs from that of {_short(names[0])} (largest "
                    f"difference {difference:.3g}): Megatron fuses {', '.join(_leaf(m) for m in names)} into one adapter "
                    f"with one A ({name}), so this adapter has no exact form at rank {rank}; {MERGE_INSTEAD}")
        adapters[name] = (a, merge(layout, [modules[module][1] for module in names], arch))
    if not adapters:
        raise ConfigError(f"{directory}/{ADAPTER_WEIGHTS} holds no LoRA adapters")
    targets = [target for target in TARGET_WEIGHTS if any(lora_target(name) == target for name in adapters)]
    for name in table:  # a target adapts every layer (and expert) it names in Megatron
        if lora_target(name) in targets and name not in adapters:
            raise ConfigError(f"{directory}: the adapter has no {_short(table[name][0][0])}, but model.lora's target "
                              f"{lora_target(name)!r} adapts every one of them (the adapter has others); {MERGE_INSTEAD}")
    _check_targets(directory, config, modules, arch)
    return PeftAdapter(adapters, rank, alpha, float(config.get("lora_dropout") or 0.0), targets,
                       config.get("base_model_name_or_path"))


def read_adapter_config(directory: Path) -> dict:
    """adapter_config.json, its settings checked key by key: a LoRA adapter that is
    W + (lora_alpha / r) B A on the modules its tensors name, or a refusal naming the file, the key,
    its value and what to do (the tables above)."""
    path = directory / ADAPTER_CONFIG
    if not directory.is_dir():
        raise ConfigError(f"--adapter {directory} is not a directory (a PEFT adapter: {ADAPTER_CONFIG} and "
                          f"{ADAPTER_WEIGHTS})")
    if not path.is_file():
        raise ConfigError(f"{path} is missing: {directory} is not a PEFT adapter directory")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not readable JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        found = config.get("peft_type") if isinstance(config, dict) else config
        raise ConfigError(f"{path}: peft_type={found!r}: only LoRA adapters (peft_type LORA) are imported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1):
        raise ConfigError(f"{path}: r={rank!r} must be an integer >= 1")
    if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and alpha > 0):
        raise ConfigError(f"{path}: lora_alpha={alpha!r} must be a number > 0")
    dropout = config.get("lora_dropout") or 0.0
    if not (isinstance(dropout, (int, float)) and 0 <= dropout < 1):
        raise ConfigError(f"{path}: lora_dropout={dropout!r} must be in [0, 1) (model.lora.dropout)")
    try:  # they become the checkpoint's model.lora: its bounds, named here rather than on a command line
        LoraConfig(rank=rank, alpha=float(alpha), dropout=float(dropout)).validate("model.lora")
    except ConfigError as exc:
        raise ConfigError(f"{path}: r, lora_alpha and lora_dropout are model.lora's rank, alpha and dropout, and "
                          f"{exc}") from None
    for key, value in config.items():
        if key not in HONOURED and key not in METADATA and key not in UNREPRESENTABLE:
            raise ConfigError(
                f"{path}: {key}={value!r} is not a setting of peft's LoraConfig that this import knows (peft 0.21's "
                "fields), so whether it changes the model cannot be told (peft itself ignores a key it does not "
                "know, which would load a newer variant of LoRA as plain LoRA); it is refused, not ignored: remove "
                f"it from {ADAPTER_CONFIG} if it does not change the forward, or {MERGE_INSTEAD}")
        if key in UNREPRESENTABLE and not _at_default(key, value, rank, alpha):
            raise ConfigError(f"{path}: {key}={value!r} {UNREPRESENTABLE[key]}; model.lora cannot represent it: "
                              f"{MERGE_INSTEAD}")
    init = config.get("init_lora_weights", True)
    if init_kind(init) is None:
        changing = isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS)
        why = ("changes the base weights when peft builds the adapter (the base minus the initial adapter) or makes "
               "it a variant of LoRA, so peft's model from this adapter is not the base's W + (lora_alpha / r) B A"
               if changing else "is not an initialization this import knows")
        raise ConfigError(f"{path}: init_lora_weights={init!r} {why}; model.lora cannot represent it: {MERGE_INSTEAD}")
    named = config.get("base_model_name_or_path")
    if named is not None and not isinstance(named, str):
        raise ConfigError(f"{path}: base_model_name_or_path={named!r} must be a string (the base model's name or path)")
    return config


def _at_default(key: str, value, rank: int, alpha: float) -> bool:
    """Whether UNREPRESENTABLE setting `key` is at a value with no effect: peft's default or one
    equivalent to it (None, false, empty; bias "none"; every pattern value the config's own r or
    lora_alpha). `0` is not false here: layers_to_transform=0 is layer 0."""
    if key == "bias":
        return value in (None, "none")
    if key in ("rank_pattern", "alpha_pattern") and isinstance(value, dict):
        default = rank if key == "rank_pattern" else alpha
        return all(isinstance(v, (int, float)) and not isinstance(v, bool) and v == default for v in value.values())
    if key in NONE_ONLY:
        return value is None
    return value is None or value is False or (isinstance(value, (str, list, dict, tuple)) and len(value) == 0)


def _module_tensors(directory: Path, arch: ArchitectureSpec, shapes: dict, rank: int) -> dict[str, tuple]:
    """{PEFT module name: (lora_A, lora_B)} of adapter_model.safetensors, every key consumed or refused."""
    path = directory / ADAPTER_WEIGHTS
    if not path.is_file():
        if (directory / PICKLED_WEIGHTS).is_file():
            raise ConfigError(f"{directory / PICKLED_WEIGHTS} is a pickle, and loading a pickle can run code, so it is "
                              f"never read: save the adapter as safetensors ({ADAPTER_WEIGHTS}: "
                              "PeftModel.save_pretrained(directory) does by default, or load it once with peft and "
                              "save it again) and pass that directory")
        raise ConfigError(f"{path} is missing: {directory} is not a PEFT adapter directory")
    known = {module for names, _ in peft_table(arch).values() for module in names}
    modules: dict[str, dict[str, torch.Tensor]] = {}
    with open_safetensors(path) as handle:
        for key in sorted(handle.keys()):
            module, _, kind = key.removesuffix(".weight").rpartition(".")
            if not (key.startswith(PREFIX) and key.endswith(".weight") and kind in ("lora_A", "lora_B")):
                raise ConfigError(f"{path}: tensor {key} is not a LoRA adapter's lora_A or lora_B weight (names are "
                                  f"{PREFIX}MODULE.lora_A.weight); it cannot be imported, and is not left out unread")
            if module not in known:
                raise ConfigError(f"{path}: tensor {key}: {arch.architecture} has no module {_short(module)} that "
                                  f"model.lora adapts (its targets: {', '.join(TARGET_WEIGHTS)})")
            modules.setdefault(module, {})[kind] = _checked(path, key, handle.get_tensor(key), module, kind, shapes,
                                                            rank)
    for module, pair in modules.items():
        if len(pair) < 2:
            have, lack = ("lora_A", "lora_B") if "lora_A" in pair else ("lora_B", "lora_A")
            raise ConfigError(f"{path}: {module}.{have}.weight has no {module}.{lack}.weight beside it")
    return {module: (pair["lora_A"], pair["lora_B"]) for module, pair in modules.items()}


def _checked(path: Path, key: str, tensor: torch.Tensor, module: str, kind: str, shapes: dict, rank: int):
    weight = module.removeprefix(PREFIX) + ".weight"
    if weight not in shapes:
        raise ConfigError(f"{path}: tensor {key} adapts {weight}, which the base model does not hold: is the adapter "
                          "of another model?")
    out_features, in_features = shapes[weight]
    want = (rank, in_features) if kind == "lora_A" else (out_features, rank)
    if tuple(tensor.shape) != want:
        raise ConfigError(f"{path}: tensor {key} has shape {list(tensor.shape)}; the base's "
                          f"{_short(module)} [{out_features}, {in_features}] at r={rank} needs {list(want)}")
    if not tensor.is_floating_point() or non_finite(tensor):
        raise ConfigError(f"{path}: tensor {key} ({tensor.dtype}) is not a finite floating-point tensor")
    return tensor


def _check_targets(directory: Path, config: dict, modules: dict, arch: ArchitectureSpec) -> None:
    """target_modules against the tensors, so that the modules peft adapts when it loads the adapter
    are the ones the tensors name: a list names exactly the leaves the tensors adapt (peft adapts
    every module whose name ends in a listed one, and the tensors cover every layer and piece of
    their targets: read_peft_adapter); a pattern (peft's regular expression, or "all-linear")
    matches every module the tensors name, on a model without experts. With an initialization
    that starts lora_B nonzero, a module peft adapts without a tensor would change the model: only
    a list on a model without experts rules that out."""
    path = directory / ADAPTER_CONFIG
    listed = config.get("target_modules")
    leaves = {_leaf(module) for module in modules}
    init = config.get("init_lora_weights", True)
    if init_kind(init) == "random" and (not isinstance(listed, list) or arch.is_moe):
        raise ConfigError(
            f"{path}: init_lora_weights={init!r} starts the adapters peft builds with a nonzero lora_B, so a module "
            f"its target_modules={listed!r} adapts without a tensor in {ADAPTER_WEIGHTS} would change the model, and "
            f"{'a pattern' if not isinstance(listed, list) else 'a MoE model'}'s modules are not checked one by one "
            f"here; set init_lora_weights to true in {ADAPTER_CONFIG} (it only starts the adapters the file's "
            "tensors replace, and starts lora_B at 0 anywhere else)")
    if isinstance(listed, str):
        if arch.is_moe:
            raise ConfigError(
                f"{path}: target_modules={listed!r} is a pattern, and which of a MoE model's expert and router "
                "modules peft adapts from a pattern (transformers 5 fuses the experts) is not checked here; list the "
                f"adapted modules instead: \"target_modules\": {json.dumps(sorted(leaves))}")
        if listed == "all-linear":
            return  # every module the import reads on a dense model is a linear one
        try:
            pattern = re.compile(listed)
        except re.error as exc:
            raise ConfigError(f"{path}: target_modules={listed!r} is not a regular expression ({exc})") from None
        unmatched = sorted(_short(module) for module in modules if not pattern.fullmatch(_short(module)))
        if unmatched:
            raise ConfigError(f"{path}: target_modules={listed!r} does not match {unmatched[0]}, which "
                              f"{ADAPTER_WEIGHTS} adapts: peft would leave it unadapted and its tensors unread")
        return
    if not isinstance(listed, list) or not all(isinstance(name, str) for name in listed):
        raise ConfigError(f"{path}: target_modules={listed!r} must be a list of module names or a pattern (without "
                          "one peft adapts its own default modules for the architecture, which are not checked here); "
                          f"list the adapted modules: \"target_modules\": {json.dumps(sorted(leaves))}")
    unused = sorted(set(listed) - leaves)
    if unused:
        raise ConfigError(f"{path}: target_modules names {unused[0]!r}, but "
                          f"{ADAPTER_WEIGHTS} holds no adapter on a module of that name in this model (it adapts "
                          f"{', '.join(sorted(leaves))}): is it the adapter of another model?")
    unlisted = sorted(leaves - set(listed))
    if unlisted:
        raise ConfigError(f"{path}: target_modules {listed} lacks {unlisted[0]!r}, which "
                          f"{ADAPTER_WEIGHTS} adapts: the two files are not of one adapter")


def _short(module: str) -> str:
    return module.removeprefix(PREFIX)


def _leaf(module: str) -> str:
    return module.rsplit(".", 1)[-1]


class AdapterValues:
    """save_megatron_checkpoint(values=...) for a model built on the meta device with model.lora:
    the imported adapters' values (this rank's shards, split as model/lora.py splits them: a
    column-parallel B on its rows in W's fused layout, a row-parallel A on its columns), and
    `weights` (bridge/streamed.MetaValues) for everything else."""

    def __init__(self, module, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], arch: ArchitectureSpec,
                 weights: Callable[[torch.Tensor], torch.Tensor]):
        self._weights = weights
        self._values: dict[int, torch.Tensor] = {}
        layouts = {name: layout for name, (_, layout) in peft_table(arch).items()}
        for placement in placements(module):
            if placement.adapter is None:
                continue
            if placement.global_name not in adapters:
                raise RuntimeError(f"the model has an adapter on {placement.global_name}, the imported adapter none")
            a, b = adapters[placement.global_name]
            group = placement.tp_group
            if placement.tp_dim == 0:  # column-parallel: B's rows, each fused piece split like W's
                pieces = split(layouts[placement.global_name], b, arch)
                b = merge(layouts[placement.global_name], [p.chunk(group.size())[group.rank()] for p in pieces], arch)
            elif placement.tp_dim == 1:  # row-parallel: A's columns
                a = a.chunk(group.size(), dim=1)[group.rank()]
            for meta, value in zip(placement.adapter[:2], (a, b)):
                if tuple(value.shape) != tuple(meta.shape):
                    raise RuntimeError(f"the adapter of {placement.global_name}: {list(value.shape)} imported, the "
                                       f"model has {list(meta.shape)}")
                self._values[storage_key(meta)] = value.to(meta.dtype).contiguous()

    def __call__(self, view: torch.Tensor) -> torch.Tensor:
        value = self._values.get(storage_key(view))
        return self._weights(view) if value is None else view_like(value, view)
