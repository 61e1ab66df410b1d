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
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.checkpoint.format import (
    USE_ANOTHER, check_weight_files, read_metadata, unloadable, weights_path,
)
from megatron_rl.checkpoint.lora_record import checked_lora
from megatron_rl.checkpoint.store import STATE
from megatron_rl.errors import ConfigError
from megatron_rl.model.hf_config import parse_hf_config
from megatron_rl.tools.ranks import hf_model_config, layout_args, model_on_this_rank, validate_layout

MEGATRON_TO_PEFT = "a LoRA run's Megatron checkpoint -> its adapters as a PEFT directory (adapter_config.json + " \
                   "adapter_model.safetensors, for peft.PeftModel.from_pretrained on the HF base)"
PEFT_TO_MEGATRON = "a PEFT LoRA adapter and its HF base -> one Megatron torch_dist checkpoint holding both, for " \
                   "checkpoint.init_from of a run with the model.lora it implies"
LORA_KEYS = ("rank", "alpha", "dropout", "targets", "init")
BASE_DIR = "base"  # megatron-to-peft --write-base: OUT/base/, the adapters' base as a Hugging Face directory


def recorded_model(ckpt: Path) -> dict:
    """The run's `model` config as its trainer_state.json records it; for a checkpoint written by
    `convert peft-to-megatron` (no trainer state) the model.lora it recorded, and {} for one
    written by `convert hf-to-megatron`. Its `lora` is None without LoRA."""
    path = ckpt / STATE
    if not path.is_file():
        lora = read_metadata(ckpt).get("lora")
        return {"lora": lora} if lora else {}
    try:
        model = json.loads(path.read_text()).get("config", {}).get("model") or {}
    except (ValueError, AttributeError) as exc:
        raise ConfigError(f"{path} is not the JSON object a run writes ({exc}); {USE_ANOTHER}") from exc
    if not isinstance(model, dict):
        raise ConfigError(f"{path}: config.model must be an object, not {type(model).__name__}; {USE_ANOTHER}")
    if model.get("lora") is not None:
        checked_lora(model["lora"], path, "config.model.lora")
    return model


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
    parser.add_argument("--write-base", action="store_true",
                        help=f"also write the base the adapters were trained on as a Hugging Face directory "
                             f"OUT/{BASE_DIR}/, named in adapter_config.json (needed when that base is not a Hugging "
                             "Face directory: a run from random initialization or from a megatron-rl checkpoint, a "
                             "checkpoint holding its base)")
    return parser


@dataclass
class TrainedBase:
    """The base a LoRA checkpoint's adapters were trained on (checkpoint/base_ref.py): a Hugging
    Face directory (`hf`, with its model files as the run read them, checked unchanged), or
    torch_dist weights (`weights`: the base the checkpoint refers to, or the one it holds)."""

    what: str  # in words, for messages
    hf: Path | None = None
    files: dict | None = None
    checkpoint: Path | None = None  # the megatron-rl checkpoint whose weights hold it

    @property
    def weights(self) -> Path:
        return weights_path(self.checkpoint)


def trained_base(ckpt: Path, metadata: dict, model: dict) -> TrainedBase:
    """The base `ckpt`'s adapters were trained on: the one its megatron_rl.json refers to (checked
    against the checksums the run recorded), else the weights it holds beside its adapters. Never
    the run's model.hf_config, which gives the architecture only (a run from random
    initialization trains on a random base with that shape)."""
    from megatron_rl.checkpoint.base_check import check_base, refers_to_base

    if refers_to_base(metadata):
        reference = metadata["base"]
        base = check_base(reference, ckpt).resolve()
        if reference.get("kind") == "hf":
            return TrainedBase(f"the Hugging Face model {base}", hf=base, files=reference["files"])
        check_weight_files(weights_path(base))
        source = _recorded_source(base)
        found = TrainedBase(f"the megatron-rl checkpoint {base}" + (f" ({source})" if source else ""),
                            checkpoint=base)
        return _converted_from_hf(found, read_metadata(base))
    origin = _held_base_origin(ckpt, metadata, model)
    found = TrainedBase(f"the base weights {ckpt} holds beside them" + (f" ({origin})" if origin else ""),
                        checkpoint=ckpt)
    return _converted_from_hf(found, metadata)


def _converted_from_hf(base: TrainedBase, metadata: dict) -> TrainedBase:
    """`base` (a megatron-rl checkpoint's weights), or, when that checkpoint records it was
    converted without a change of value from a Hugging Face directory (`hf_base`: `convert
    peft-to-megatron`), that directory, once its files match the recorded checksums."""
    from megatron_rl.checkpoint.base_check import base_problem, locate

    origin = metadata.get("hf_base")
    if not (isinstance(origin, dict) and origin.get("exact") is True and origin.get("kind") == "hf"):
        return base
    problem = base_problem(origin, base.checkpoint)
    if problem:  # not the model it was converted from any more: the checkpoint's weights are the base
        return TrainedBase(f"{base.what}, converted from {origin['path']}, which is not that model any more "
                           f"({problem})", checkpoint=base.checkpoint)
    hf = locate(origin, base.checkpoint).resolve()
    return TrainedBase(f"the Hugging Face model {hf} ({base.checkpoint} was converted from it)", hf=hf,
                       files=origin["files"], checkpoint=base.checkpoint)


def _recorded_source(ckpt: Path) -> str | None:
    try:
        source = read_metadata(ckpt).get("source")
    except ConfigError:
        return None
    return source if isinstance(source, str) else None


def _held_base_origin(ckpt: Path, metadata: dict, model: dict) -> str | None:
    """Where the base a checkpoint holds came from, in words: the run's checkpoint.init_from (its
    trainer state), or what the writer recorded (`megatron-rl sft`, `convert peft-to-megatron`)."""
    if (ckpt / STATE).is_file():
        try:
            checkpoint = json.loads((ckpt / STATE).read_text()).get("config", {}).get("checkpoint") or {}
        except (ValueError, AttributeError):
            checkpoint = {}
        init = checkpoint.get("init_from") if isinstance(checkpoint, dict) else None
        return f"loaded from {init}" if init else "the run's random initialization"
    source = metadata.get("source")
    return f"from {source}" if isinstance(source, str) and source else None


def refuse_unnamed_base(ckpt: Path, base: TrainedBase, model: dict, out: Path) -> None:
    """megatron-to-peft without --write-base on a checkpoint whose base is not a Hugging Face
    directory: adapter_config.json would name no base, or (as it once did) the run's
    model.hf_config, on whose weights the adapters mean something else."""
    architecture = model.get("hf_config")
    raise ConfigError(
        f"{ckpt}: its adapters were trained on {base.what}, which is not a Hugging Face model directory that PEFT "
        "can load, so adapter_config.json cannot name it"
        + (f" (the run's model.hf_config {architecture} gives only its architecture)" if architecture else "")
        + f"; pass --write-base to write that base as a Hugging Face directory {out / BASE_DIR} beside the adapter, "
        "named in adapter_config.json, or export the merged model (`megatron-rl convert megatron-to-hf "
        "--merge-lora`); a run started from a Hugging Face model (checkpoint.init_from=HF_DIR) exports naming it")


def peft_export_bytes(ckpt: Path, base: TrainedBase) -> int:
    """What --write-base adds to the output, about: the base's model files or its tensors."""
    from megatron_rl.tools.output_sizes import megatron_to_hf_bytes

    if base.hf is not None:
        return sum(entry["bytes"] for entry in base.files.values())
    return megatron_to_hf_bytes(base.checkpoint, ckpt / "hf_config")


def write_peft_export(ckpt: Path, metadata: dict, model: dict, written, out: Path,
                      base: TrainedBase | None = None) -> int:
    """megatron-to-peft once its output and input are checked (tools/convert.py): the adapters read
    whole and written as a PEFT directory into `written()`'s staging (convert.written_atomically),
    adapter_config.json naming the base they were trained on: the Hugging Face directory the
    checkpoint refers to, or, given `base` (--write-base: trained_base(ckpt)), that base written
    as a Hugging Face directory OUT/base/ beside them (named by its absolute path, `out` being
    where the output appears). `model`: recorded_model(ckpt). Returns how many adapters it wrote."""
    from megatron_rl.bridge.peft_export import write_peft_directory
    from megatron_rl.checkpoint.base_check import refers_to_base

    named = trained_base(ckpt, metadata, model) if base is None else base
    write_base = base is not None
    if not write_base and named.hf is None:
        refuse_unnamed_base(ckpt, named, model, out)
    config = one_process_config(ckpt, metadata, model["lora"])
    check_weight_files(weights_path(ckpt))
    with model_on_this_rank(config, meta=True) as (_, built):
        adapters = read_checkpoint_adapters(built.module, weights_path(ckpt))
        if refers_to_base(metadata):  # it holds the state training moves; the base, the state as it was
            refuse_moved_state(ckpt, named, built)
        with written() as (staging, checksums):
            lora = config.model.lora
            base_path = Path(out).resolve() / BASE_DIR if write_base else named.hf
            write_peft_directory({name: (a, b) for name, (a, b, _) in adapters.items()}, built.arch, lora.rank,
                                 lora.alpha, lora.dropout, staging, base_model=str(base_path))
            if write_base:
                written_base = _write_hf_base(named, built, ckpt, metadata, staging / BASE_DIR)
                checksums.update({f"{BASE_DIR}/{name}": entry for name, entry in written_base.items()})
    return len(adapters)


def refuse_moved_state(ckpt: Path, base: TrainedBase, built) -> None:
    """A checkpoint that refers to its base holds the state buffers training moves (the routers'
    expert bias, model.moe_router_bias_update_rate), and a PEFT adapter cannot carry them: PEFT on
    the base would route tokens as the base does, not as the run's model does. Refused, naming the
    first buffer that differs from the base's and by how much."""
    import torch

    from megatron_rl.bridge.importer import checkpoint_index, open_safetensors
    from megatron_rl.bridge.mappings import expand
    from megatron_rl.bridge.placement import placements
    from megatron_rl.bridge.streamed import _IndexReadOnce, _load, _Parameter, _sharded_by_storage, storage_key
    from megatron_rl.checkpoint.unpickling import read_torch_dist_index

    buffers = [p for p in placements(built.module) if not isinstance(p.param, torch.nn.Parameter)]
    if not buffers:
        return
    sharded = _sharded_by_storage(built.module)
    items = [_Parameter(p, (), "plain", sharded[storage_key(p.param)]) for p in buffers]

    def read(weights: Path) -> list[torch.Tensor]:
        return _load(items, _IndexReadOnce(str(weights), read_torch_dist_index(weights)))

    trained = read(weights_path(ckpt))
    if base.hf is not None:
        hf_names, index = {name: hf[0] for name, hf, _ in expand(built.arch)}, checkpoint_index(base.hf)
        original = []
        for placement in buffers:
            with open_safetensors(index[hf_names[placement.global_name]]) as handle:
                original.append(handle.get_tensor(hf_names[placement.global_name]))
    else:
        original = read(base.weights)
    for placement, now, then in zip(buffers, trained, original):
        difference = (now.double() - then.double()).abs().max().item()
        if difference != 0:
            raise ConfigError(
                f"{ckpt}: its {placement.global_name} (the router's expert bias, which the run moved: "
                f"model.moe_router_bias_update_rate) differs from that of the base it was trained on, {base.what} "
                f"(largest difference {difference:.3g}), and a PEFT adapter cannot carry it: PEFT on that base would "
                "route tokens to other experts than the run's model does; use the run's own merged model (its "
                "hf_model/, written at the end of the run), or train with model.moe_router_bias_update_rate=0 for "
                "adapters PEFT can load")


def _write_hf_base(base: TrainedBase, built, ckpt: Path, metadata: dict, target: Path) -> dict[str, dict]:
    """`base` as a Hugging Face directory `target` with its own MANIFEST.json: the Hugging Face
    base's model files copied as the run read them, or the torch_dist base's weights streamed
    (bridge/streamed.py, adapters left out) with config.json and the checkpoint's tokenizer files.
    Returns each file's size and CRC-32."""
    import shutil

    from megatron_rl.checkpoint.store import write_manifest

    target.mkdir()
    if base.hf is not None:
        for relative in sorted(base.files):
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(base.hf / relative, target / relative)
        known = dict(base.files)
    else:
        from megatron_rl.bridge.hf_checkpoint import write_hf_config
        from megatron_rl.bridge.streamed import TorchDistUnreadable, write_hf_from_torch_dist
        from megatron_rl.checkpoint.unpickling import read_torch_dist_index

        try:
            # adapters={}: the weights alone, whether or not the directory holds adapters beside them
            known = write_hf_from_torch_dist(built.module, built.arch, base.weights,
                                             read_torch_dist_index(base.weights), target,
                                             precision=metadata["precision"], adapters={})
        except TorchDistUnreadable as exc:
            raise ConfigError(unloadable(base.weights, exc.__cause__) if exc.__cause__ is not None
                              else f"{base.weights}: {exc}; {USE_ANOTHER}") from exc
        write_hf_config(built.raw_hf_config, built.arch, target, template_dir=ckpt / "hf_config")
    return write_manifest(target, known=known)


class PeftInput:
    """peft-to-megatron's adapter (tools/convert.py: hf_to_megatron with peft=True): `--adapter`
    read and checked against the base `--hf` (bridge/peft_import.py) when built, before anything
    heavy; then the config overrides of the model.lora it implies, the checkpoint writer's values
    with the adapters in them, and what megatron_rl.json records."""

    def __init__(self, args, raw: dict):
        from megatron_rl.bridge.peft_import import base_shapes, read_peft_adapter

        self.path, self.hf_dir = Path(args.adapter), Path(args.hf_dir)
        self.adapter = read_peft_adapter(self.path, parse_hf_config(raw), base_shapes(args.hf_dir))
        check_named_base(self.path, self.adapter.named_base, Path(args.hf_dir))

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

    def record(self, precision: str) -> dict:
        """megatron_rl.json's fields: the model.lora, the adapter, the base it named, and the base
        written beside the adapters (`hf_base`, hf_base_record) for megatron-to-peft to name."""
        import os

        return {"lora": self.adapter.lora, "peft_adapter": str(self.path.resolve()),
                "peft_base_model_name_or_path": self.adapter.named_base,
                # megatron_rl.json is global rank 0's to write: the other ranks read no checksum
                "hf_base": hf_base_record(self.hf_dir, precision) if os.environ.get("RANK", "0") == "0" else None}


def hf_base_record(hf_dir: Path, precision: str) -> dict:
    """The Hugging Face directory a converted checkpoint's base weights come from, as
    checkpoint/base_ref.describe_source names a base (its model files with their sizes and CRC-32:
    its MANIFEST.json's when it has one, checked by the conversion), and `exact`: whether the
    conversion kept every weight's value (every floating tensor upcast, or bf16 kept bf16), so that
    the checkpoint's base is that directory's model and megatron-to-peft may name it."""
    from megatron_rl.bridge.importer import checkpoint_index, open_safetensors
    from megatron_rl.checkpoint.base_ref import describe_source

    keeps = {"fp32": {"F32", "BF16", "F16"}, "bf16": {"BF16"}}[precision]
    by_file: dict[Path, list[str]] = {}
    for name, file in checkpoint_index(hf_dir).items():
        by_file.setdefault(file, []).append(name)
    dtypes = set()
    for file, names in by_file.items():  # the headers only
        with open_safetensors(file) as handle:
            dtypes.update(handle.get_slice(name).get_dtype() for name in names)
    floating = {dtype for dtype in dtypes if dtype.startswith(("F", "BF"))}
    return dict(describe_source(hf_dir), exact=floating <= keeps)


def check_named_base(adapter: Path, named: str | None, hf_dir: Path) -> None:
    """Refuse an adapter whose adapter_config.json names, as the base it was trained on, a local
    directory other than --hf whose weights differ (tensor names, shapes or values): the adapters
    mean something else on another base. A name that is no local directory of safetensors weights
    (a Hub name, a path of another machine, a config directory) cannot be compared and is recorded
    only (megatron_rl.json `peft_base_model_name_or_path`)."""
    from megatron_rl.bridge.importer import checkpoint_index
    from megatron_rl.bridge.peft_export import ADAPTER_CONFIG

    if not named or not Path(named).is_dir() or Path(named).resolve() == hf_dir.resolve():
        return
    try:
        theirs = checkpoint_index(named)
    except ConfigError:
        return  # no weights there (or none readable): nothing to compare with
    difference = _weights_difference(theirs, checkpoint_index(hf_dir))
    if difference:
        raise ConfigError(
            f"{adapter / ADAPTER_CONFIG}: base_model_name_or_path={named!r} names the base the adapter was trained on, "
            f"and its weights differ from those of --hf {hf_dir} ({difference}): the adapters mean something else on "
            f"another base; pass --hf {named}, or, if {hf_dir} is the base the adapter was trained on, set "
            f"base_model_name_or_path to it in {ADAPTER_CONFIG}")


def _weights_difference(theirs: dict[str, Path], ours: dict[str, Path]) -> str | None:
    """The first tensor that differs between two Hugging Face weight sets ({name: file}), in words,
    or None when every tensor is equal (whatever the files' sharding)."""
    from contextlib import ExitStack

    import torch

    from megatron_rl.bridge.importer import open_safetensors

    only = sorted(set(theirs) ^ set(ours))
    if only:
        return f"tensor {only[0]} is in {'it' if only[0] in theirs else '--hf'} only"
    with ExitStack() as stack:
        handles = {file: stack.enter_context(open_safetensors(file)) for file in {*theirs.values(), *ours.values()}}
        for name in sorted(ours):
            a, b = handles[theirs[name]].get_tensor(name), handles[ours[name]].get_tensor(name)
            if a.shape != b.shape:
                return f"tensor {name}: shape {list(a.shape)} and {list(b.shape)}"
            if not torch.equal(a.double(), b.double()):
                return f"tensor {name}: largest difference {(a.double() - b.double()).abs().max().item():.3g}"
    return None
