"""checkpoint/base_ref.py and base_check.py on files, in process: how a LoRA checkpoint names its base, and every
way the base can differ from what the run read (tests/model/test_lora.py and
tests/train/test_lora_rl.py load real checkpoints over real bases)."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import pytest

from megatron_rl.checkpoint import base_check, base_ref
from megatron_rl.errors import ConfigError


def hf_base(root: Path) -> Path:
    base = root / "hf"
    (base / ".cache").mkdir(parents=True)
    (base / "config.json").write_text('{"model_type": "qwen3"}')
    (base / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (base / ".cache" / "download.lock").write_text("a download's lock")
    (base / "README.md").write_text("a model card, which may be edited")
    return base


def test_a_hf_base_is_named_by_path_with_the_files_that_make_the_model(tmp_path):
    base = hf_base(tmp_path)
    reference = base_ref.describe_source(base)
    assert reference["kind"] == "hf" and reference["path"] == str(base.resolve())
    assert sorted(reference["files"]) == ["config.json", "model.safetensors"]  # not the card, not the cache
    data = (base / "model.safetensors").read_bytes()
    assert reference["files"]["model.safetensors"] == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    assert base_check.base_problem(reference, tmp_path / "anywhere") is None  # absolute: from any checkpoint


def test_a_checkpoint_that_refers_to_a_base_passes_that_base_on(tmp_path):
    """init_from a LoRA checkpoint: the new run's base is that checkpoint's base, absolute."""
    base = hf_base(tmp_path)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000004"
    ckpt.mkdir(parents=True)
    (ckpt / "weights").mkdir()
    relative = dict(base_ref.describe_source(base), path="../../../hf")
    (ckpt / "megatron_rl.json").write_text(json.dumps({"format": "megatron_rl.torch_dist.v1", "weights_dir": "weights",
                                                      "padded_vocab_size": 128, "precision": "fp32",
                                                      "base": relative}))
    assert base_check.locate(relative, ckpt) == tmp_path / "hf"  # no "step_000004/../" left in names
    passed_on = base_ref.describe_source(ckpt)
    assert passed_on == dict(relative, path=str(base.resolve()))
    # a checkpoint inside the run's checkpoints keeps the relative name, one elsewhere gets the absolute
    assert base_check.portable(relative, ckpt, ckpt.parent) == relative
    assert base_check.portable(relative, ckpt, tmp_path / "other" / "checkpoints")["path"] == str(base.resolve())


@pytest.mark.parametrize("change, named", [
    ("missing", "model.safetensors is missing"),
    ("longer", "model.safetensors has 1025 bytes, 1024 when the run read it"),
    ("flipped", "model.safetensors has CRC-32 "),
    ("moved", "does not exist (moved or deleted?)"),
])
def test_every_change_of_the_base_is_refused_naming_the_file(tmp_path, change, named):
    base = hf_base(tmp_path)
    reference = base_ref.describe_source(base)
    weights = base / "model.safetensors"
    if change == "missing":
        weights.unlink()
    elif change == "longer":
        weights.write_bytes(weights.read_bytes() + b"\0")
    elif change == "flipped":
        data = bytearray(weights.read_bytes())
        data[100] ^= 1
        weights.write_bytes(bytes(data))
    else:
        base.rename(tmp_path / "elsewhere")
    with pytest.raises(ConfigError) as refused:
        base_check.check_base(reference, tmp_path / "run" / "checkpoints" / "step_000002")
    message = str(refused.value)
    assert named in message and str(base) in message and "step_000002" in message, message
    if change == "flipped":  # same size: the preflight's size check passes, the CRC-32 does not
        assert base_check.base_problem(reference, tmp_path, checksums=False) is None


@pytest.mark.parametrize("entry, named", [
    ("not an object", '"base" must be an object with a "path"'),
    ({"path": "/x", "files": {}}, '"base" must list its "files"'),
    ({"path": "/x", "files": {"../../etc/passwd": {"bytes": 1, "crc32": "0"}}}, "lies outside the base"),
    ({"path": "/x", "files": {"config.json": {"bytes": "1"}}}, 'needs "bytes" and "crc32"'),
])
def test_a_malformed_base_entry_is_refused_not_followed(tmp_path, entry, named):
    """megatron_rl.json is untrusted input: an entry of the wrong shape, or one naming files
    outside the base, is refused before any file is read."""
    problem = base_check.base_problem(entry, tmp_path)
    assert problem is not None and named in problem and "edited or damaged" in problem, problem


# ---- what is checked is what is loaded (bridge/checked_read.py) ------------------------------


def torch_dist_base(root: Path) -> tuple[Path, dict, dict]:
    """A torch_dist directory as a base holds it (.metadata, one .distcp file), its reference as a
    run records it, and the values."""
    import torch
    import torch.distributed.checkpoint as dcp

    from megatron_rl.checkpoint.store import write_manifest

    base = root / "base"
    values = {"embedding": torch.arange(64, dtype=torch.float32).reshape(8, 8), "norm": torch.ones(5) * 3,
              "bias": torch.arange(10.0)}
    dcp.save({k: v.clone() for k, v in values.items()}, checkpoint_id=str(base), no_dist=True)
    write_manifest(base)
    return base, base_ref.describe_written(base, root / "step_000001"), values


def load_checked(base: Path, reference: dict, checkpoint: Path, values: dict) -> dict:
    """The values loaded from `base` as Megatron-Core's torch_dist load reads them inside
    checked_torch_dist (its reader, from the function Megatron-Core makes it with), the error a
    rank's reader raised unwrapped as format.raise_load_failure unwraps it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_rl.bridge.streamed import failure_to_reraise
    from megatron_rl.bridge.checked_read import checked_torch_dist

    target = {k: torch.zeros_like(v) for k, v in values.items()}
    with checked_torch_dist(base, base_check.base_record(reference, checkpoint)):
        reader = mcore_torch._get_filesystem_reader(str(base), cache_metadata=True)
        try:
            dcp.load(target, storage_reader=reader, no_dist=True)
        except CheckpointException as exc:
            raise failure_to_reraise(exc) or exc
    assert type(mcore_torch._get_filesystem_reader(str(base))).__name__ == "FileSystemReader"  # put back
    return target


def plus_one(file: Path, values=None) -> None:
    """The first 16 of `values` (float32: the embedding of the bases above) +1.0 where the file
    stores them, rewritten in place: the same size, only a checksum tells."""
    import torch

    stored = (torch.arange(64, dtype=torch.float32) if values is None else values).reshape(-1)[:16].numpy().tobytes()
    data = bytearray(file.read_bytes())
    start = bytes(data).index(stored)
    changed = torch.frombuffer(bytearray(stored), dtype=torch.float32) + 1.0
    data[start:start + len(stored)] = changed.numpy().tobytes()
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("when", ["intact", "after_the_check", "during_the_load"])
def test_a_torch_dist_base_is_checked_on_the_bytes_the_load_reads(tmp_path, monkeypatch, when):
    """A LoRA resume compared the base with its record, closed the files and loaded them again:
    a file rewritten in between (same size, 16 embedding values +1.0) was trained on. The load
    now takes each file's CRC-32 on the bytes it reads and keeps no byte it has not checked: a
    file rewritten after the check, or while it is being read, fails that load, naming it."""
    import torch

    from megatron_rl.bridge import checked_read

    base, reference, values = torch_dist_base(tmp_path)
    ckpt = tmp_path / "step_000001"
    victim = base / "__0_0.distcp"
    assert base_check.base_problem(reference, ckpt) is None  # the check before the load passes
    if when == "after_the_check":
        plus_one(victim)
    elif when == "during_the_load":
        read_at = checked_read.CheckedFile.read_at

        def read_then_rewrite(self, offset, length):
            data = read_at(self, offset, length)
            if self.relative == victim.name and not getattr(self, "rewritten", False):
                self.rewritten = True
                plus_one(victim, values["norm"])  # stored after the embedding: read after this
            return data

        monkeypatch.setattr(checked_read.CheckedFile, "read_at", read_then_rewrite)
    if when == "intact":
        loaded = load_checked(base, reference, ckpt, values)
        assert all(torch.equal(loaded[k], values[k]) for k in values)
        return
    assert base_check.base_problem(reference, ckpt, checked_on_load=checked_read.CHECKED_ON_LOAD) is None
    with pytest.raises(ConfigError) as refused:
        load_checked(base, reference, ckpt, values)
    message = str(refused.value)
    assert f"the base model {base} it refers to has changed: __0_0.distcp has CRC-32 " in message, message
    assert "when the run read it" in message and str(ckpt) in message, message


def test_a_file_the_record_does_not_list_is_not_loaded(tmp_path):
    base, reference, values = torch_dist_base(tmp_path)
    del reference["files"]["__0_0.distcp"]
    with pytest.raises(ConfigError, match="__0_0.distcp is read by the load but was not there when the run read it"):
        load_checked(base, reference, tmp_path / "step_000001", values)


def safetensors_base(root: Path) -> tuple[Path, dict]:
    import torch
    from safetensors.torch import save_file

    base = root / "hf"
    base.mkdir(parents=True)
    values = {"model.embed_tokens.weight": torch.arange(64, dtype=torch.float32).reshape(8, 8),
              "model.norm.weight": torch.ones(8, dtype=torch.bfloat16), "empty": torch.zeros(0, 8)}
    save_file(values, str(base / "model.safetensors"))
    (base / "config.json").write_text("{}")
    return base, values


@pytest.mark.parametrize("when", ["intact", "after_the_check", "replanned"])
def test_safetensors_are_checked_on_the_bytes_the_load_reads(tmp_path, when):
    """The Hugging Face importer's reading under a record (bridge/importer.read_checked_tensors):
    the tensors asked for, each file read once front to back, its CRC-32 compared on those
    bytes; a file rewritten after the check (16 embedding values +1.0), or whose tensors are no
    longer what the load was planned with, is refused naming it."""
    import torch
    from safetensors import safe_open

    from megatron_rl.bridge.importer import read_checked_tensors

    base, values = safetensors_base(tmp_path)
    ckpt = tmp_path / "step_000001"
    reference = base_ref.describe_source(base)
    record = base_check.base_record(reference, ckpt)
    file = base / "model.safetensors"
    if when == "replanned":  # the load is planned on another file, then reads the recorded one
        from safetensors.torch import save_file

        recorded_file = file.rename(tmp_path / "recorded.safetensors")
        save_file(dict(values, **{"model.norm.weight": torch.ones(2, 4, dtype=torch.bfloat16)}), str(file))
    with safe_open(str(file), "pt") as planned:
        slices = {name: planned.get_slice(name) for name in values}
        if when == "after_the_check":
            plus_one(file)
        elif when == "replanned":
            recorded_file.replace(file)
        if when == "intact":
            read = read_checked_tensors(file, set(values), record, slices.__getitem__)
            assert all(torch.equal(read[n][:], values[n]) and read[n].get_dtype() == slices[n].get_dtype()
                       for n in values)
            return
        with pytest.raises(ConfigError) as refused:
            read_checked_tensors(file, set(values), record, slices.__getitem__)
    named = ("model.safetensors has CRC-32 " if when == "after_the_check" else "model.safetensors changed while it "
             "was loaded (tensor model.norm.weight: BF16 [8], planned as BF16 [2, 4]")
    assert f"the base model {base.resolve()} it refers to has changed: {named}" in str(refused.value), refused.value


# ---- weights never leave the model's directory --------------------------------------------------


@pytest.mark.parametrize("entry", ["../blob/w.safetensors", "/abs/w.safetensors", "link.safetensors"])
def test_a_hf_index_naming_weights_outside_the_directory_is_refused(tmp_path, entry):
    """An HF base whose model.safetensors.index.json maps a tensor to `../blob/w.safetensors`: the
    importer followed it, and the base reference (the directory's own files) never checked that
    file. Every reader finds the files through checkpoint_index, which refuses an entry leading
    outside (`..`, absolute, a symbolic link), naming the index, the tensor and the entry; the
    base reference is refused the same."""
    from megatron_rl.bridge.importer import check_files, checkpoint_index

    base, _ = safetensors_base(tmp_path)
    (tmp_path / "blob").mkdir()
    (base / "model.safetensors").rename(tmp_path / "blob" / "w.safetensors")
    (base / "link.safetensors").symlink_to(tmp_path / "blob" / "w.safetensors")
    index = base / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": entry}}))
    for read in (checkpoint_index, check_files, base_ref.describe_source):
        with pytest.raises(ConfigError) as refused:
            read(base)
        message = str(refused.value)
        assert f"{index}: tensor model.norm.weight is mapped to {entry!r}, which " in message, message
        assert ("leads outside" if entry.startswith("link") else "lies outside") in message
        assert "weights are read from its own directory only" in message


def test_a_weight_file_linked_from_outside_the_directory_is_refused(tmp_path):
    """Without an index the importer reads every *.safetensors of the directory: one that is a
    symbolic link to a file elsewhere is refused, and so is a base whose recorded file became one."""
    from megatron_rl.bridge.importer import checkpoint_index

    base, _ = safetensors_base(tmp_path)
    reference = base_ref.describe_source(base)
    (base / "model.safetensors").rename(tmp_path / "w.safetensors")
    (base / "model.safetensors").symlink_to(tmp_path / "w.safetensors")
    with pytest.raises(ConfigError, match="weight file model.safetensors leads outside"):
        checkpoint_index(base)
    problem = base_check.base_problem(reference, tmp_path / "step_000001")
    assert "has changed: model.safetensors leads outside" in problem, problem
    with pytest.raises(ConfigError, match="model.safetensors leads outside"):
        base_ref.describe_source(base)


def test_a_hugging_face_hub_cache_snapshot_is_read_through_its_links(tmp_path):
    """The hub cache (where users download models) keeps each file of a snapshot as a link to the
    repository's blobs/: those links are followed (and the bytes checked as any file's); a link
    from the snapshot to anywhere else is still refused."""
    from megatron_rl.bridge.importer import checkpoint_index

    base, _ = safetensors_base(tmp_path)
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in base.iterdir():
        blob = repo / "blobs" / f"blob-{file.name}"
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(Path("../..") / "blobs" / blob.name)
    def names(index):
        return {tensor: path.name for tensor, path in index.items()}

    assert names(checkpoint_index(snapshot)) == names(checkpoint_index(base))
    assert base_ref.describe_source(snapshot)["files"] == base_ref.describe_source(base)["files"]
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    (tmp_path / "elsewhere.safetensors").write_bytes((base / "model.safetensors").read_bytes())
    with pytest.raises(ConfigError, match="weight file model.safetensors leads outside"):
        checkpoint_index(snapshot)


# ---- the base disappears during the run (checkpoint/manager.py) ----------------------------------


def manager_with_base(tmp_path: Path, reference: dict):
    from types import SimpleNamespace

    from megatron_rl.checkpoint.manager import CheckpointManager
    from megatron_rl.config import load_config

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    config = load_config(None, [f"output_dir={tmp_path / 'out'}"])
    manager = CheckpointManager(config, SimpleNamespace(rank=0, dp_size=1, device="cpu"), model_dir=tmp_path / "model")
    manager.root.mkdir(parents=True, exist_ok=True)
    manager.policy = SimpleNamespace(module=SimpleNamespace(vocab_size=128))
    manager.base = reference
    return manager


def saves_recorded(monkeypatch) -> list[dict]:
    """store.begin_save replaced: the metadata of each checkpoint the manager begins."""
    from types import SimpleNamespace

    from megatron_rl.checkpoint import store

    begun = []

    def begin_save(root, step, policy, trainer_state, *, metadata, **_):
        begun.append(metadata)
        return SimpleNamespace(process=None, stats=SimpleNamespace(step=step))

    monkeypatch.setattr(store, "begin_save", begin_save)
    return begun


def test_a_run_whose_base_disappears_stops_before_its_next_checkpoint(tmp_path, monkeypatch):
    """checkpoint.init_from's base removed during a LoRA run: the run went on to "done", and every
    checkpoint it wrote referred to the missing base, so none resumed. Before each checkpoint the
    manager checks that the base is there with its recorded sizes (no file read), and stops the
    run with one line naming it and what to do; the checkpoints so far stay."""
    from megatron_rl.errors import TrainingStopped

    base = hf_base(tmp_path)
    manager = manager_with_base(tmp_path, base_ref.describe_source(base))
    begun = saves_recorded(monkeypatch)
    manager.after_step(2, {}, stop=True, last=False)
    assert len(begun) == 1 and begun[0]["base"]["path"] == str(base.resolve())
    (base / "model.safetensors").write_bytes(b"shorter")  # a size check sees it
    for change in ("resized", "removed"):
        if change == "removed":
            shutil.rmtree(base)
        with pytest.raises(TrainingStopped) as stopped:
            manager.after_step(3, {}, stop=True, last=False)
        line = str(stopped.value)
        assert len(begun) == 1 and "\n" not in line, line  # no checkpoint begun
        assert line.startswith("step 3: this run's checkpoints refer to their base model") and str(base) in line
        named = "does not exist (moved or deleted?)" if change == "removed" else "model.safetensors has 7 bytes"
        assert named in line, line
        assert "before writing checkpoint step_000003" in line and "checkpoints so far are kept" in line
        assert f"Put the base back at {base.resolve()} as it was" in line


def test_a_run_whose_own_base_disappears_writes_it_again(tmp_path, monkeypatch, capsys):
    """The base of a run from random initialization (checkpoints/base, written from the frozen
    weights the run still holds) removed during the run: it is written again, and the next
    checkpoint refers to the new one."""
    base, reference, _ = torch_dist_base(tmp_path / "out" / "checkpoints")
    manager = manager_with_base(tmp_path, reference)
    begun = saves_recorded(monkeypatch)
    rewritten = dict(reference, path="../base-1234abcd")
    monkeypatch.setattr(manager, "_write_own_base", lambda: rewritten)
    manager.after_step(2, {}, stop=True, last=False)
    assert begun[-1]["base"] == reference  # there: nothing written
    shutil.rmtree(base)
    manager.after_step(3, {}, stop=True, last=False)
    assert begun[-1]["base"] == rewritten and manager.base == rewritten
    said = capsys.readouterr().out
    assert f"the base model {base} it refers to does not exist" in said and "written again" in said, said
    assert "checkpoint step_000003 and the later ones refer to it" in said


def test_a_base_whose_manifest_lists_sizes_alone_is_recorded_with_checksums(tmp_path):
    """A manifest of an older megatron-rl lists each file's size alone: the base reference that
    init_from takes from it gets every CRC-32 (a reference without one is refused at resume)."""
    base = hf_base(tmp_path)
    data = (base / "model.safetensors").read_bytes()
    (base / "MANIFEST.json").write_text(json.dumps({"files": {"model.safetensors": len(data),
                                                              "config.json": {"bytes": 23, "crc32": "1234abcd"}}}))
    reference = base_ref.describe_source(base)
    assert reference["files"] == {"model.safetensors": {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"},
                                  "config.json": {"bytes": 23, "crc32": "1234abcd"}}
    assert base_check.base_problem(reference, tmp_path, checksums=False) is None
