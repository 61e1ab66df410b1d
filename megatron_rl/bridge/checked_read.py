"""Loading files against a record of their sizes and CRC-32s (a LoRA checkpoint's base
reference, checkpoint/base_check.py), so that what is checked is what is loaded.

Comparing the files with the record and then loading them leaves a window: a file rewritten in
between (same size, other values) would be loaded unchecked. So the weight files are checked by
the load itself: each is read front to back once, the CRC-32 taken on every byte as it passes,
and the load keeps only bytes it has taken the checksum of; once the file is read to its end the
size and CRC-32 are compared with the record, and a difference fails the load, naming the file.
A file the record does not list is refused before it is read. The files the load does not read
this way (configs, megatron_rl.json, Megatron's common.pt: small) are compared before it.

    recorded = Recorded(base_dir, reference["files"], refuse)
    with checked_torch_dist(weights_dir, recorded):     # Megatron-Core's torch_dist loads
        policy.load_model(...)
    load_hf_weights(module, arch, hf_dir, recorded)     # safetensors (bridge/importer.py)

Memory: a .distcp file's stored items are read in file order, one at a time (each as big as one
stored tensor shard); a safetensors file's tensors that this rank needs, while it loads them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import zlib
from pathlib import Path
from typing import Callable

from megatron_rl.errors import ConfigError

# Loaded through this module, so their CRC-32 is taken as they are loaded (the rest: before).
CHECKED_ON_LOAD = (".safetensors", ".distcp")
_CHUNK = 16 << 20


@dataclasses.dataclass
class Recorded:
    """The files of directory `root` as recorded ({relative name: {"bytes", "crc32"}});
    `refuse(problem)` makes the error for a problem with one file ("x.distcp has CRC-32 ...")."""

    root: Path
    files: dict[str, dict]
    refuse: Callable[[str], ConfigError]

    def entry(self, file: Path) -> tuple[str, dict]:
        relative = os.path.relpath(file, self.root)
        entry = self.files.get(relative)
        if entry is None:
            raise self.refuse(f"{relative} is read by the load but was not there when the run read it")
        return relative, entry

    def compare(self, relative: str, entry: dict, size: int, crc32: str) -> None:
        if size != entry["bytes"]:
            raise self.refuse(f"{relative} has {size} bytes, {entry['bytes']} when the run read it")
        if crc32 != entry["crc32"]:
            raise self.refuse(f"{relative} has CRC-32 {crc32}, {entry['crc32']} when the run read it")


def outside(root: Path, name) -> str | None:
    """Why `name` (a file name read from a manifest, an index or a reference: untrusted) does not
    name a file inside directory `root` ("lies outside ROOT", ...: the caller names it), or None:
    not a non-empty string, absolute, a `..` part, or a symbolic link (the file's or a folder's
    on the way) that leads out of `root`. One layout's links are followed: a Hugging Face hub
    cache snapshot (`models--ORG--NAME/snapshots/REVISION/FILE`) holds every file as a link to the
    repository's `blobs/`, which is where users download models to; the loads read (and check)
    the linked bytes as they would a file in the directory."""
    if not isinstance(name, str) or not name or "\0" in name:
        return "is not a file name"
    if os.path.isabs(name) or ".." in Path(name).parts:
        return f"lies outside {root}"
    resolved = (Path(root) / name).resolve()
    if not resolved.is_relative_to(Path(root).resolve()) and not _hub_cache_blob(Path(root), resolved):
        return f"leads outside {root} (through a symbolic link)"
    return None


def _hub_cache_blob(root: Path, resolved: Path) -> bool:
    """Whether `resolved` is a blob of the hub cache repository whose snapshot `root` is."""
    snapshots = Path(os.path.abspath(root)).parent
    if snapshots.name != "snapshots" or not snapshots.parent.name.startswith("models--"):
        return False
    return resolved.parent == (snapshots.parent / "blobs").resolve() and resolved.is_file()


class CheckedFile:
    """One recorded file, read front to back once with its CRC-32 taken on every byte. `read_at`
    hands out byte ranges in increasing order (the last one may be asked again); `finish` reads
    the rest and compares size and checksum with the record."""

    def __init__(self, recorded: Recorded, file: Path):
        self.recorded = recorded
        self.relative, self.entry = recorded.entry(file)
        self._handle = open(file, "rb", buffering=0)  # no read-ahead: each byte is read when it is taken
        self._crc, self._front = 0, 0
        self._last: tuple[int, bytearray] = (0, bytearray())

    def read_at(self, offset: int, length: int) -> bytearray:
        start, data = self._last
        if start <= offset and offset + length <= start + len(data):
            return data[offset - start:offset - start + length]
        if offset < self._front:
            raise RuntimeError(f"{self.relative}: bytes {offset}.. asked after {self._front} were read; a checked "
                               "file is read in order")
        self._take(offset - self._front, None)
        data = bytearray(length)
        taken = self._take(length, memoryview(data))
        if taken < length:  # the file ends early: it is not the recorded one
            self.finish()
            raise self.recorded.refuse(f"{self.relative} ends at byte {self._front}")
        self._last = (offset, data)
        return data

    def _take(self, count: int, into: memoryview | None) -> int:
        """The next `count` bytes (fewer at the end of the file) into `into`, or dropped."""
        done = 0
        while done < count:
            piece = self._handle.read(min(count - done, _CHUNK))
            if not piece:
                break
            self._crc = zlib.crc32(piece, self._crc)
            if into is not None:
                into[done:done + len(piece)] = piece
            done += len(piece)
        self._front += done
        return done

    def whole(self) -> bytearray:
        """The whole file (a small one: an index), checked."""
        try:
            data = self.read_at(0, self.entry["bytes"])
            self.finish()
        finally:
            self.close()
        return data

    def finish(self) -> None:
        while self._take(_CHUNK, None):
            pass
        self.close()
        self.recorded.compare(self.relative, self.entry, self._front, f"{self._crc & 0xFFFFFFFF:08x}")

    def close(self) -> None:
        self._handle.close()
        self._last = (0, bytearray())


@contextlib.contextmanager
def checked_torch_dist(weights: Path, recorded: Recorded):
    """Inside the block, Megatron-Core's torch_dist loads of directory `weights` read its files
    through `recorded`: the index (.metadata) whole, each .distcp file front to back with its
    stored items in file order. A file that differs fails the load (on the rank that read it;
    torch gathers the error to every rank)."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    original = mcore_torch._get_filesystem_reader
    directory = Path(weights).resolve()

    def reader(checkpoint_dir, cache_metadata: bool = False):
        if Path(checkpoint_dir).resolve() != directory:
            return original(checkpoint_dir, cache_metadata)
        return _checked_reader(checkpoint_dir, recorded)

    mcore_torch._get_filesystem_reader = reader
    try:
        yield
    finally:
        mcore_torch._get_filesystem_reader = original


def _checked_reader(path, recorded: Recorded):
    """torch's checkpoint reader (the one Megatron-Core makes), reading through CheckedFile."""
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
    )
    from torch.distributed.checkpoint.filesystem import FileSystem

    class CheckedFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path, mode):
            if mode != "rb":
                raise ValueError(f"{path}: a checked load only reads")
            checked = CheckedFile(recorded, Path(path))
            if not str(path).endswith(".distcp"):  # the index (.metadata)
                yield io.BytesIO(checked.whole())
                return
            try:
                yield checked  # CheckedReader._slice_file takes its items
            except BaseException:
                checked.close()
                raise
            checked.finish()

    class CheckedReader(CachedMetadataFileSystemReader):
        def __init__(self, path):
            super().__init__(path)
            self.fs = CheckedFileSystem()

        def read_data(self, plan, planner):
            # torch reads a file's items in the plan's order: in file order, each file is read once.
            def place(item):
                stored = self.storage_data[item.storage_index]
                return stored.relative_path, stored.offset

            return super().read_data(dataclasses.replace(plan, items=sorted(plan.items, key=place)), planner)

        def _slice_file(self, file, sinfo):
            return io.BytesIO(file.read_at(sinfo.offset, sinfo.length))

    return CheckedReader(path)
