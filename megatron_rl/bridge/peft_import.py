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

Everything is checked before anything is built or written, and refused by name (the key and its
value, and what to do): adapter_config.json's settings that change the forward beyond
W + (lora_alpha / r) B A (rsLoRA, DoRA, modules_to_save, per-module ranks or alphas, trained
biases, ...); every tensor of adapter_model.safetensors is consumed or refused (an unknown key, a
module this model lacks, a shape that does not fit the base, an A without its B, a fused module
with a piece missing, a target covering only some of its layers or experts); a pickled
adapter_model.bin is never loaded. Adapters on transformers 5's fused expert parameters
(`target_parameters`) are refused: the names read are the per-expert modules the export writes.
"""

from __future__ import annotations

import json
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
from megatron_rl.errors import ConfigError
from megatron_rl.model.hf_config import ArchitectureSpec

PICKLED_WEIGHTS = "adapter_model.bin"
MERGE_INSTEAD = ("merge the adapter into its base instead (peft's merge_and_unload, then save_pretrained) and convert "
                 "that with `megatron-rl convert hf-to-megatron`")
# adapter_config.json settings that change the forward beyond W + (lora_alpha / r) B A: set (true,
# non-empty), they are refused with what they do.
UNREPRESENTABLE = {
    "use_rslora": "scales the adapters by lora_alpha / sqrt(r), model.lora by alpha / rank",
    "use_dora": "adds DoRA's trained magnitude per output, which model.lora has not",
    "modules_to_save": "trains whole copies of these modules beside the adapters",
    "rank_pattern": "gives some modules a rank of their own; model.lora has one rank",
    "alpha_pattern": "gives some modules an alpha of their own; model.lora has one alpha",
    "lora_bias": "trains a bias beside lora_B",
    "fan_in_fan_out": "stores the adapters transposed (Conv1D layers), which no family here has",
    "target_parameters": "adapts parameters directly (transformers 5's fused expert tensors); the import reads the "
                         "per-expert modules (target_modules) that transformers < 5 and this project's export name",
    "layer_replication": "builds the model with replicated layers",
    "trainable_token_indices": "trains rows of the embedding",
    "alora_invocation_tokens": "activates the adapters only after its invocation tokens (aLoRA)",
    "use_qalora": "pools the adapters' input for a quantized base (QALoRA)",
    "use_bdlora": "shares block-diagonal adapters over tensor-parallel shards (BD-LoRA)",
    "arrow_config": "routes between several adapters (Arrow)",
}


@dataclass
class PeftAdapter:
    adapters: dict[str, tuple[torch.Tensor, torch.Tensor]]  # Megatron weight name -> (A, B), whole
    rank: int
    alpha: float
    dropout: float
    targets: list[str]  # model.lora targets, in config/model.py's order

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
    _check_target_modules(directory, config, modules)
    return PeftAdapter(adapters, rank, alpha, float(config.get("lora_dropout") or 0.0), targets)


def read_adapter_config(directory: Path) -> dict:
    """adapter_config.json, its settings checked: a LoRA adapter that is W + (lora_alpha / r) B A."""
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
    for key, why in UNREPRESENTABLE.items():
        if config.get(key):
            raise ConfigError(f"{path}: {key}={config[key]!r} {why}; model.lora cannot represent it: {MERGE_INSTEAD}")
    if config.get("bias", "none") != "none":
        raise ConfigError(f"{path}: bias={config['bias']!r} trains the base's biases beside the adapters; model.lora "
                          f"cannot represent it: {MERGE_INSTEAD}")
    return config


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


def _check_target_modules(directory: Path, config: dict, modules: dict) -> None:
    """A list of target_modules names exactly the leaves the tensors adapt (a pattern string is
    PEFT's regular expression: the tensors say what it matched)."""
    listed = config.get("target_modules")
    if not isinstance(listed, list):
        return
    leaves = {_leaf(module) for module in modules}
    unused = sorted(set(listed) - leaves)
    if unused:
        raise ConfigError(f"{directory / ADAPTER_CONFIG}: target_modules names {unused[0]!r}, but "
                          f"{ADAPTER_WEIGHTS} holds no adapter on a module of that name in this model (it adapts "
                          f"{', '.join(sorted(leaves))}): is it the adapter of another model?")
    unlisted = sorted(leaves - set(listed))
    if unlisted:
        raise ConfigError(f"{directory / ADAPTER_CONFIG}: target_modules {listed} lacks {unlisted[0]!r}, which "
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
