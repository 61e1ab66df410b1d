"""`megatron-rl convert` for a LoRA run's checkpoint (model.lora; docs/lora.md).

    megatron-rl convert megatron-to-peft --ckpt RUN/checkpoints/step_000020 --out adapter/
    megatron-rl convert megatron-to-hf --merge-lora --ckpt ... --out merged/
    megatron-rl convert peft-to-megatron --hf BASE --adapter adapter/ --out ckpt/ [--tp/--pp/--ep ...]

A LoRA run's checkpoint holds the adapters and refers to its base (checkpoint/base_check.py), or,
written with checkpoint.base_weights=saved, holds the base beside them; its
trainer_state.json names the run's model.lora (rank, alpha, targets). The model is built on the
meta device with those settings at TP1/PP1/EP1, so the adapters name their torch_dist keys
whatever layout the run saved at, and they are read whole (bridge/streamed.read_adapters).
megatron-to-peft writes them as a PEFT directory (bridge/peft_export.py); megatron-to-hf
--merge-lora merges each into its weight while streaming the HF export.

peft-to-megatron is hf-to-megatron with a PEFT adapter (`PeftInput`): the adapter is read and
checked whole (bridge/peft_import.py) before anything is built, the model is built with the
model.lora it implies, and the checkpoint holds the base weights and the adapters, with that
model.lora recorded in megatron_rl.json (`lora`), which `checkpoint.init_from` checks the run's
against (checkpoint/lora_record.check_run_lora). The commands themselves, with their output and input
checks, are in tools/convert.py; this module does not import it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_rl.checkpoint.format import (
    USE_ANOTHER, check_weight_files, read_metadata, unloadable, weights_path,
)
from megatron_rl.checkpoint.store import STATE
from megatron_rl.errors import ConfigError
from megatron_rl.model.hf_config import parse_hf_config
from megatron_rl.tools.ranks import hf_model_config, layout_args, model_on_this_rank, validate_layout

MEGATRON_TO_PEFT = "a LoRA run's Megatron checkpoint -> its adapters as a PEFT directory (adapter_config.json + " \
                   "adapter_model.safetensors, for peft.PeftModel.from_pretrained on the HF base)"
PEFT_TO_MEGATRON = "a PEFT LoRA adapter and its HF base -> one Megatron torch_dist checkpoint holding both, for " \
                   "checkpoint.init_from of a run with the model.lora it implies"
LORA_KEYS = ("rank", "alpha", "dropout", "targets", "init")


def recorded_model(ckpt: Path) -> dict:
    """The run's `model` config as its trainer_state.json records it; for a checkpoint written by
    `convert peft-to-megatron` (no trainer state) the model.lora it recorded, and {} for one
    written by `convert hf-to-megatron`. Its `lora` is None without LoRA."""
    path = ckpt / STATE
    if not path.is_file():
        lora = read_metadata(ckpt).get("lora")
        return {"lora": lora} if lora else {}
    try:
        return json.loads(path.read_text()).get("config", {}).get("model") or {}
    except (ValueError, AttributeError) as exc:
        raise ConfigError(f"{path} is not the JSON object a run writes ({exc}); {USE_ANOTHER}") from exc


def lora_overrides(lora: dict) -> list[str]:
    """Config overrides that build the model with the run's adapters (values as YAML)."""
    return [f"model.lora.{key}={json.dumps(lora[key])}" for key in LORA_KEYS if key in lora]


def one_process_config(ckpt: Path, metadata: dict, lora: dict | None):
    """The whole model (TP1, PP1, EP1) of the checkpoint, with the run's adapters when `lora`."""
    one_process = argparse.Namespace(tp=1, pp=1, ep=1, etp=None)
    config = hf_model_config(str(ckpt / "hf_config"), one_process, metadata["precision"],
                             [f"model.padded_vocab_size={metadata['padded_vocab_size']}",
                              *(lora_overrides(lora) if lora else [])])
    validate_layout(config)
    return config


def read_checkpoint_adapters(module, weights: Path) -> dict:
    """bridge/streamed.read_adapters, with an unreadable checkpoint named."""
    from megatron_rl.bridge.streamed import TorchDistUnreadable, read_adapters
    from megatron_rl.checkpoint.unpickling import read_torch_dist_index

    try:
        return read_adapters(module, weights, read_torch_dist_index(weights))
    except TorchDistUnreadable as exc:
        raise ConfigError(unloadable(weights, exc.__cause__) if exc.__cause__ is not None
                          else f"{weights}: {exc}; {USE_ANOTHER}") from exc


def base_weights_for_merge(ckpt: Path, metadata: dict) -> Path:
    """The torch_dist weights the merged export streams its base from: the checkpoint's own, or,
    for a checkpoint that refers to its base (checkpoint/base_check.py), that base's, once its
    files are checked against the checksums the run recorded."""
    from megatron_rl.checkpoint.base_check import check_base, refers_to_base

    if not refers_to_base(metadata):
        return weights_path(ckpt)
    reference = metadata["base"]
    if reference.get("kind") != "megatron":
        raise ConfigError(
            f"{ckpt} refers to its base, the Hugging Face model {reference.get('path')}, and the merged export "
            "streams the base from a megatron-rl checkpoint: convert the base once (`megatron-rl convert "
            "hf-to-megatron`) and merge by hand, or use the run's own hf_model/ (merged), or export the "
            "adapters (`megatron-rl convert megatron-to-peft`) and merge them on the base with peft")
    base = check_base(reference, ckpt)
    check_weight_files(weights_path(base))
    return weights_path(base)


def require_lora(ckpt: Path, lora: dict | None, flag: str) -> dict:
    if lora is None:
        raise ConfigError(f"{ckpt} is not a checkpoint of a LoRA run: its {STATE} names no model.lora, so it holds "
                          f"no adapters to {flag}; convert it with `megatron-rl convert megatron-to-hf` alone")
    return lora


def megatron_to_peft_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=MEGATRON_TO_PEFT)
    parser.add_argument("--ckpt", required=True, help="a LoRA run's checkpoint (or its run directory: the newest)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    return parser


def write_peft_export(ckpt: Path, metadata: dict, model: dict, written) -> int:
    """megatron-to-peft once its output and input are checked (tools/convert.py): the adapters read
    whole and written as a PEFT directory into `written()`'s staging (convert.written_atomically).
    `model`: recorded_model(ckpt). Returns how many adapters it wrote."""
    from megatron_rl.bridge.peft_export import write_peft_directory

    config = one_process_config(ckpt, metadata, model["lora"])
    check_weight_files(weights_path(ckpt))
    with model_on_this_rank(config, meta=True) as (_, built):
        adapters = read_checkpoint_adapters(built.module, weights_path(ckpt))
        with written() as (staging, _checksums):
            lora = config.model.lora
            write_peft_directory({name: (a, b) for name, (a, b, _) in adapters.items()}, built.arch, lora.rank,
                                 lora.alpha, lora.dropout, staging, base_model=model.get("hf_config"))
    return len(adapters)


class PeftInput:
    """peft-to-megatron's adapter (tools/convert.py: hf_to_megatron with peft=True): `--adapter`
    read and checked against the base `--hf` (bridge/peft_import.py) when built, before anything
    heavy; then the config overrides of the model.lora it implies, the checkpoint writer's values
    with the adapters in them, and what megatron_rl.json records."""

    def __init__(self, args, raw: dict):
        from megatron_rl.bridge.peft_import import base_shapes, read_peft_adapter

        self.path = Path(args.adapter)
        self.adapter = read_peft_adapter(self.path, parse_hf_config(raw), base_shapes(args.hf_dir))

    @staticmethod
    def parser(prog: str) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog=prog, description=PEFT_TO_MEGATRON)
        parser.add_argument("--hf", "--hf-dir", dest="hf_dir", required=True, help="the adapter's base model (HF)")
        parser.add_argument("--adapter", required=True, help="the PEFT adapter directory (adapter_config.json, "
                                                             "adapter_model.safetensors)")
        parser.add_argument("--out", required=True)
        parser.add_argument("--precision", choices=["fp32", "bf16"], default=None,
                            help="parameter dtype (default: the base's dtype when it is fp32 or bf16)")
        layout_args(parser)
        return parser

    def overrides(self) -> list[str]:
        return lora_overrides(self.adapter.lora)

    def values(self, built, weights):
        from megatron_rl.bridge.peft_import import AdapterValues

        return AdapterValues(built.module, self.adapter.adapters, built.arch, weights)

    def record(self) -> dict:
        return {"lora": self.adapter.lora, "peft_adapter": str(self.path.resolve())}
