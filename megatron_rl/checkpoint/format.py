"""The Megatron checkpoint format every megatron-rl tool and run reads and writes.

A Megatron checkpoint directory holds Megatron's torch_dist files plus:
    hf_config/           the model's config.json and tokenizer files (the model is self-described)
    megatron_rl.json     format tag, padded vocabulary size, the layout and precision it was saved at

`save_megatron_checkpoint` writes this format (`megatron-rl convert`, `megatron-rl sft`); the
conversion back to Hugging Face reads it, and `megatron-rl train checkpoint.init_from=DIR` starts
from it. A training checkpoint (checkpoint/store.py) is the same format with its weights in a
subdirectory ("weights_dir").

MANIFEST.json (every file's size and CRC-32; checkpoint/store.py writes and verifies it) comes
with every training checkpoint and every `megatron-rl convert` output, in both directions (a
Hugging Face directory too). Readers verify it before loading (`check_intact`); a directory
without one (sft output, older conversions, downloads) has nothing to verify.

A checkpoint can be named in any of these forms (`resolve_checkpoint`):
    DIR                   a directory holding megatron_rl.json (convert, sft output)
    RUN/checkpoints/step_000030   a training checkpoint: megatron_rl.json says where the weights are
                                  ("weights_dir"); its MANIFEST.json is verified before loading
    RUN/checkpoints       the step its `latest` file names
    RUN                   a run directory: RUN/checkpoints/latest
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from pathlib import Path
from typing import NoReturn

# Which directory a checkpoint path names: no torch there (`megatron-rl eval` tells kinds apart before importing it).
from megatron_rl.checkpoint.locate import (LATEST, METADATA, is_megatron_checkpoint, names_megatron_checkpoint,  # noqa: F401
                                           resolve_checkpoint)
from megatron_rl.checkpoint.base_check import base_record, check_base, locate, refers_to_base
from megatron_rl.bridge.checked_read import CHECKED_ON_LOAD, Recorded, checked_torch_dist
from megatron_rl.checkpoint.streaming_save import streaming_save_strategy
from megatron_rl.config import RunConfig
from megatron_rl.data.tokenizer import write_char_tokenizer
from megatron_rl.errors import ConfigError

FORMAT = "megatron_rl.torch_dist.v1"
MANIFEST = "MANIFEST.json"  # every file's size and CRC-32 (megatron_rl.checkpoint.manifest.write_manifest)
USE_ANOTHER = "re-convert it, or use another checkpoint (e.g. an earlier step_* directory of the run)"
REDOWNLOAD_OR_CONVERT = "download or convert the model again"  # a damaged Hugging Face directory


def save_megatron_checkpoint(module, raw_hf_config: dict, directory: Path, config: RunConfig, *,
                             tokenizer_dir: str | Path | None, source: str, extra: dict | None = None,
                             values=None, checksums: dict | None = None, without_adapters: bool = False) -> None:
    """Collective: the model's weights as torch_dist files in `directory` (empty, e.g. an
    AtomicDirectory's staging), then, on global rank 0, hf_config/ (config.json and the tokenizer
    files found in `tokenizer_dir`) and megatron_rl.json. `extra`: more fields for megatron_rl.json.
    `values`: for a model built on the meta device, what gives each meta tensor its values while
    it is written (bridge/streamed.py: MetaValues); the model itself never holds them.
    `checksums`: receives this rank's .distcp files with their size and CRC-32, taken while
    writing them (store.write_manifest's `known`: no second read for the manifest).
    `without_adapters`: LoRA adapters left out (a LoRA run's base: base_ref.py)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_rl.bridge.hf_checkpoint import copy_tokenizer_files
    from megatron_rl.model.state import is_adapter

    directory = Path(directory)
    sharded = {k: v for k, v in module.sharded_state_dict().items() if not (without_adapters and is_adapter(k))}
    dist_checkpointing.save(sharded, str(directory), sharded_strategy=streaming_save_strategy(values, checksums))
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    (directory / "hf_config").mkdir()
    (directory / "hf_config" / "config.json").write_text(json.dumps(raw_hf_config, indent=2) + "\n")
    copy_tokenizer_files(tokenizer_dir, directory / "hf_config")
    p = config.parallel
    metadata = {
        "format": FORMAT,
        "padded_vocab_size": module.vocab_size,
        "precision": config.model.precision,
        "saved_layout": {"tp": p.tp, "pp": p.pp, "ep": p.ep, "etp": p.expert_tp},
        "source": source,
        # The adapters' settings, which conversions and checkpoint.init_from read (checkpoint/
        # lora_record.py); a training checkpoint records them in its trainer state instead.
        **({"lora": dataclasses.asdict(config.model.lora)} if config.model.lora and not without_adapters else {}),
        **(extra or {}),
    }
    (directory / METADATA).write_text(json.dumps(metadata, indent=2) + "\n")


def weights_path(ckpt: str | Path) -> Path:
    """The directory of the torch_dist weight files of a checkpoint (its "weights_dir")."""
    return Path(ckpt) / read_metadata(ckpt).get("weights_dir", ".")


def check_intact(ckpt: Path, hint: str = USE_ANOTHER) -> None:
    """Refuse a checkpoint its MANIFEST.json disagrees with (a file missing, truncated or, where
    the manifest has checksums, corrupt). A training checkpoint is verified whole (trainer state
    included); a converted one (`convert` writes the manifest in both directions: a Megatron
    checkpoint or a Hugging Face directory) file by file, naming the file by its path, with
    `hint` saying what to do. Without a manifest (written by an older megatron-rl, or
    downloaded): nothing to check."""
    if not (ckpt / MANIFEST).is_file():
        return
    from megatron_rl.checkpoint import store as checkpoint

    if _is_training_checkpoint(ckpt):
        problem = checkpoint.verify(ckpt)
        hint = "use another checkpoint (e.g. an earlier step_* directory of the run)"
    else:
        problem = checkpoint.verify_files(ckpt, full_paths=True)
    if problem is not None:
        raise ConfigError(f"checkpoint {ckpt} is damaged: {problem}; {hint}")


def _is_training_checkpoint(ckpt: Path) -> bool:
    """The trainer's checkpoints keep their weights in a subdirectory that megatron_rl.json names
    (see the module docstring); converted ones beside it."""
    try:
        return "weights_dir" in json.loads((ckpt / METADATA).read_text())
    except (OSError, ValueError, TypeError):
        return False  # not a Megatron checkpoint (a Hugging Face directory) or unreadable: read_metadata says


def _check_intact_once(ckpt: Path, hint: str = USE_ANOTHER) -> None:
    """check_intact on global rank 0 only (it may read every file), the verdict shared."""
    on_rank0_shared(check_intact, ckpt, hint)


def on_rank0_shared(check, *args) -> None:
    """`check(*args)` (it raises ConfigError) on global rank 0 only, its verdict raised on every rank."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return check(*args)
    verdict = [None]
    if dist.get_rank() == 0:
        try:
            check(*args)
        except ConfigError as exc:
            verdict = [str(exc)]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise ConfigError(verdict[0])


def pin_checkpoint_vocab(config: RunConfig) -> RunConfig:
    """`config` with model.padded_vocab_size taken from checkpoint.init_from when that is a
    megatron-rl checkpoint and the size is not set: the padding depends on the TP size the
    checkpoint was saved at, and pinning it lets the checkpoint load at any other layout."""
    source = config.checkpoint.init_from
    if source is None or not names_megatron_checkpoint(source):
        return config
    return with_vocab_of(config, resolve_checkpoint(source))


def with_vocab_of(config: RunConfig, ckpt: Path) -> RunConfig:
    """`config` with model.padded_vocab_size set to the row count checkpoint `ckpt` recorded,
    unless the config sets it."""
    if config.model.padded_vocab_size is not None:
        return config
    rows = read_metadata(ckpt)["padded_vocab_size"]
    return dataclasses.replace(config, model=dataclasses.replace(config.model, padded_vocab_size=rows))


def load_initial_weights(policy, source: str | Path, recorded: Recorded | None = None) -> None:
    """checkpoint.init_from into a built Policy: a megatron-rl checkpoint in any form
    `resolve_checkpoint` takes (saved at any layout; build the policy from
    `pin_checkpoint_vocab(config)`) or a Hugging Face model directory. Collective. `recorded`:
    a LoRA checkpoint's base (load_referenced_base): the weight files are compared with the
    record on the bytes loaded (bridge/checked_read.py), not with a manifest before."""
    if names_megatron_checkpoint(source):
        ckpt = resolve_checkpoint(source)
        if recorded is None:
            _check_intact_once(ckpt)
        from megatron_rl.checkpoint.lora_record import check_run_lora

        check_run_lora(ckpt, read_metadata(ckpt), policy.config.model.lora, policy.arch)  # before a weight is read
        weights = weights_path(ckpt)
        check_weight_files(weights)
        over_base = _base_loaded_first(policy, ckpt, weights)  # a LoRA checkpoint's base, if it refers to one
        try:  # refreshes the optimizer's main weights too
            with checked_torch_dist(weights, recorded) if recorded else contextlib.nullcontext():
                policy.load_model(str(weights), **({"without_frozen": True} if over_base else {}))
        except BaseException as exc:
            raise_load_failure(weights, exc)
    else:
        from megatron_rl.bridge import load_hf_weights

        if recorded is None:  # a `convert megatron-to-hf` output has a manifest
            _check_intact_once(Path(source), REDOWNLOAD_OR_CONVERT)
        load_hf_weights(policy.module, policy.arch, source, recorded)
        policy.optimizer.reload_model_params()


def load_referenced_base(policy, reference: dict, checkpoint: Path) -> None:
    """Collective: the base `checkpoint` refers to, into `policy`, compared with the record of
    it the run made when it first read (and verified) it: every file's size, and the CRC-32 of
    the small ones, before (global rank 0 reads them, every rank gets the verdict); the weight
    files' CRC-32 on the very bytes the load reads (so a file rewritten after a check cannot be
    loaded), on the ranks that read them. The checkpoint's own tensors go over it afterwards."""
    on_rank0_shared(check_base, reference, checkpoint, True, CHECKED_ON_LOAD)
    load_initial_weights(policy, locate(reference, checkpoint), recorded=base_record(reference, checkpoint))


def _base_loaded_first(policy, ckpt: Path, weights: Path) -> bool:
    """Collective, for a megatron-rl checkpoint about to be loaded into `policy`: a LoRA run's
    checkpoint is refused by a model without adapters (it would load the base alone); one that
    refers to its base has the base loaded now (True: load the checkpoint's tensors over it)."""
    _refuse_dropped_adapters(policy, ckpt, weights)
    metadata = read_metadata(ckpt)
    if refers_to_base(metadata):
        load_referenced_base(policy, metadata["base"], ckpt)
    return refers_to_base(metadata)


def _refuse_dropped_adapters(policy, ckpt: Path, weights: Path) -> None:
    from megatron_rl.checkpoint.unpickling import read_torch_dist_index
    from megatron_rl.model.state import is_adapter

    if any(is_adapter(name) for name, _ in policy.module.named_parameters()):
        return
    if any(is_adapter(index.fqn.split("/")[0]) for index in read_torch_dist_index(weights).storage_data):
        raise ConfigError(f"{ckpt} holds LoRA adapters, and the model built to load it has none (no model.lora): "
                          "it would be the base model without them. Export the merged model "
                          "(`megatron-rl convert megatron-to-hf --merge-lora`) and load that, or build the model "
                          "with the model.lora of the run that wrote the checkpoint")


def read_metadata(ckpt: str | Path) -> dict:
    path = Path(ckpt) / METADATA
    if not path.is_file():
        raise ConfigError(f"{ckpt} is not a checkpoint written by megatron-rl ({METADATA} is missing)")
    try:
        metadata = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: not JSON, or not UTF-8
        raise ConfigError(f"{path} is unreadable ({exc}); {USE_ANOTHER}") from None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        found = metadata.get("format") if isinstance(metadata, dict) else metadata
        raise ConfigError(f"{path}: format {found!r} is not {FORMAT!r}")
    _check_fields(path, metadata)
    _check_weights_dir(Path(ckpt), metadata.get("weights_dir", "."))
    return metadata


def _check_fields(path: Path, metadata: dict) -> None:
    """The fields its readers take from megatron_rl.json (a checkpoint is untrusted input), by
    type and bound, each refusal naming the file and the key (weights_dir: _check_weights_dir)."""
    from typing import get_args

    from megatron_rl.checkpoint.base_check import malformed_reference
    from megatron_rl.checkpoint.lora_record import checked_lora
    from megatron_rl.config.model import MAX_VOCAB_ROWS, Precision

    rows = metadata.get("padded_vocab_size")
    if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= MAX_VOCAB_ROWS:
        raise ConfigError(f"{path}: padded_vocab_size must be an integer from 1 to {MAX_VOCAB_ROWS} (the "
                          f"embedding's rows), not {rows!r}; {USE_ANOTHER}")
    if metadata.get("precision") not in get_args(Precision):
        raise ConfigError(f"{path}: precision must be one of {', '.join(map(repr, get_args(Precision)))}, not "
                          f"{metadata.get('precision')!r}; {USE_ANOTHER}")
    if metadata.get("lora") is not None:
        checked_lora(metadata["lora"], path, "lora")
    problem = malformed_reference(metadata["base"]) if refers_to_base(metadata) else None
    if problem:
        raise ConfigError(f"{path}: base names the base model wrongly ({problem}); the file was edited or "
                          f"damaged; {USE_ANOTHER}")


def _check_weights_dir(ckpt: Path, relative) -> None:
    from megatron_rl.bridge.checked_read import outside

    if outside(ckpt, relative):
        raise ConfigError(f"{ckpt / METADATA}: weights_dir must be a path inside {ckpt}, got {relative!r}")
    if not (ckpt / relative).is_dir():
        raise ConfigError(f"{ckpt / METADATA}: weights_dir {relative!r} does not exist in {ckpt}: the "
                          f"checkpoint is incomplete; {USE_ANOTHER}")


def check_weight_files(weights: Path) -> None:
    """Every .distcp file the torch_dist index (.metadata) refers to exists and is long enough;
    a truncated file otherwise surfaces as a bare EOFError deep inside the loader. And nothing in
    the index, the .distcp files' pickled objects or common.pt names a callable that unpickling
    would run (checkpoint/unpickling.py): every loader of torch_dist weights calls this first."""
    from megatron_rl.checkpoint.unpickling import check_torch_dist_pickles, read_torch_dist_index

    try:
        index = read_torch_dist_index(weights)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"{weights / '.metadata'} is missing or unreadable ({_first_line(exc)}); "
                          f"{USE_ANOTHER}") from None
    from megatron_rl.bridge.checked_read import outside

    storage = index.storage_data
    needed: dict[str, int] = {}
    for item in storage.values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        problem = outside(weights, name)
        if problem:  # torch's reader would open it: a checkpoint's weights are its own files
            raise ConfigError(f"{weights / '.metadata'}: a stored tensor's file {name!r} {problem}; {USE_ANOTHER}")
        file = weights / name
        if not file.is_file():
            raise ConfigError(f"{file} is missing from the checkpoint; {USE_ANOTHER}")
        if file.stat().st_size < size:
            raise ConfigError(f"{file} is truncated ({file.stat().st_size} bytes, the checkpoint's index needs "
                              f"{size}); {USE_ANOTHER}")
    check_torch_dist_pickles(weights, index)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= 300 else text[:300] + "..."


def unloadable(weights: Path, exc: BaseException) -> str:
    """One line for an exception of the torch_dist loader, naming the .distcp file if it says which
    and, for torch's CheckpointException (which names only the failed ranks), the first rank's error."""
    text = "\n".join(str(e) for e in _chain(exc))
    file = re.search(r"[\w.-]+\.distcp", text)
    where = f" (file {weights / file.group(0)})" if file else ""
    gathered = [error for error, _ in (getattr(exc, "failures", None) or {}).values()]
    return (f"cannot load the weights in {weights}{where}: {_first_line(gathered[0] if gathered else exc)}. "
            f"A file is corrupt, or the checkpoint does not match its hf_config/; {USE_ANOTHER}")


def raise_load_failure(weights: Path, exc: BaseException) -> NoReturn:
    """For a failed torch_dist load: a stop signal and a gathered ConfigError as themselves, else one
    line (`unloadable`). torch gathers rank errors into a CheckpointException, a BaseException."""
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_rl.bridge.streamed import failure_to_reraise

    if not isinstance(exc, (Exception, CheckpointException)):
        raise exc  # KeyboardInterrupt, SystemExit: not a load failure
    raise failure_to_reraise(exc) or ConfigError(unloadable(weights, exc)) from exc


def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def load_megatron_weights(module, weights: Path) -> None:
    """Collective: the model's weights from a torch_dist directory, with one-line errors that
    name the directory (and the file where it can be told) instead of the loader's traceback."""
    import torch
    from megatron.core import dist_checkpointing

    from megatron_rl.bridge.importer import first_error, non_finite

    try:
        with torch.no_grad():
            state = dist_checkpointing.load(_merged_in_place(module.sharded_state_dict()), str(weights))
    except BaseException as exc:
        raise_load_failure(weights, exc)
    # torch_dist stores no checksum: NaN/infinite weights are the damage that can be seen.
    bad = next((name for name, value in state.items() if isinstance(value, torch.Tensor) and non_finite(value)), None)
    error = first_error(f"tensor {bad} in {weights} holds NaN or infinite values: a file is corrupt or "
                         f"the model diverged; {USE_ANOTHER}" if bad else None)
    if error:
        raise ConfigError(error)
    with torch.no_grad():
        module.load_state_dict(state)


def write_run_tokenizer(config, directory: str | Path) -> Path:
    """The tokenizer files of a run (`config`: a RunConfig) into `directory` (the rollout engine's
    model directory, an sft checkpoint): this character tokenizer for synthetic data, else the
    files of checkpoint.init_from (a Hugging Face model directory, or the hf_config/ of a
    megatron-rl checkpoint, training checkpoints and run directories included) or of the
    directory holding model.hf_config."""
    if config.data.train == "synthetic":
        return write_char_tokenizer(directory)
    from megatron_rl.bridge.hf_checkpoint import copy_tokenizer_files  # imports torch and safetensors

    source = Path(config.checkpoint.init_from or config.model.hf_config)
    source = source if source.is_dir() else source.parent
    if names_megatron_checkpoint(source):  # a checkpoint, or a run directory meaning its latest
        source = resolve_checkpoint(source) / "hf_config"
    if not copy_tokenizer_files(source, directory):
        raise ConfigError(f"no tokenizer files in {source}: set checkpoint.init_from to a Hugging Face model directory")
    return Path(directory)


def _merged_in_place(sharded_state_dict):
    """`sharded_state_dict` with its tensor factories handing back the parameter itself when their
    pieces were loaded into views of it. Megatron-Core saves a gated MLP's fc1 weight as two
    halves and loads them into views of the parameter, then concatenates them into a new tensor
    (torch.cat): a second copy of every such weight (about 60% of a MoE model) until
    load_state_dict copies it back. Pieces that are not such views are merged as before."""
    from functools import partial

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    for factory in nested_values(sharded_state_dict):
        if isinstance(factory, ShardedTensorFactory):
            factory.merge_fn = partial(_parameter_if_views, factory.merge_fn, factory.data)
    return sharded_state_dict


def _parameter_if_views(merge, parameter, pieces):
    """`parameter` if the loaded `pieces` are, in order, consecutive row blocks of it (views that
    torch.cat would put back together into it), else merge(pieces)."""
    import torch

    if not isinstance(pieces, list) or not pieces or not parameter.is_contiguous() or parameter.dim() == 0:
        return merge(pieces)
    storage, offset, rows = parameter.untyped_storage().data_ptr(), parameter.storage_offset(), 0
    for piece in pieces:
        if not (isinstance(piece, torch.Tensor) and piece.dim() == parameter.dim() and piece.is_contiguous()
                and piece.dtype == parameter.dtype and piece.untyped_storage().data_ptr() == storage
                and piece.storage_offset() == offset and piece.shape[1:] == parameter.shape[1:]):
            return merge(pieces)
        offset, rows = offset + piece.numel(), rows + piece.shape[0]
    return parameter if rows == parameter.shape[0] else merge(pieces)
