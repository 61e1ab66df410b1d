"""A checkpoint directory's MANIFEST.json: every file with its size and CRC-32, written last (it
is what says the directory is whole), and read as untrusted input: every entry must name a file
inside the directory, once, with a size (a copied or edited checkpoint is refused by name at the
first read, before any file it names is opened). Training checkpoints (store.py) and the outputs
of `megatron-rl convert` carry one."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

from megatron_rl.bridge.checked_read import outside
from megatron_rl.errors import ConfigError

MANIFEST = "MANIFEST.json"
_CHUNK = 16 << 20


def file_crc32(path: Path) -> str:
    value = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


def verify_files(path: Path, checksums: bool = True, share: tuple[int, int] = (0, 1),
                 full_paths: bool = False) -> str | None:
    """The manifest part of verify(): every file MANIFEST.json lists is there, with its size and
    CRC-32. Also what a converted checkpoint (no trainer state) is checked with. `full_paths`:
    name files by their whole path, not relative to `path`."""
    if not path.is_dir():
        return "not a directory"
    if not (path / MANIFEST).is_file():
        return f"no {MANIFEST} (the save did not finish)"
    try:
        files = read_manifest(path)
    except ConfigError as exc:
        return str(exc)
    for index, (relative, entry) in enumerate(sorted(files.items())):
        file = path / relative
        name = file if full_paths else relative
        size = entry["bytes"] if isinstance(entry, dict) else entry
        if not file.is_file():
            return f"missing file {name}"
        if file.stat().st_size != size:
            return f"file {name} has {file.stat().st_size} bytes, the manifest says {size}"
        mine = index % share[1] == share[0] or file.stat().st_size < (1 << 20)
        if checksums and mine and isinstance(entry, dict) and "crc32" in entry:
            found = file_crc32(file)
            if found != entry["crc32"]:
                return f"file {name} is corrupt (CRC-32 {found}, the manifest says {entry['crc32']})"
    return None


def read_manifest(path: Path) -> dict[str, dict | int]:
    """The files `path`/MANIFEST.json lists ({relative name: {"bytes", "crc32"}}, or the size alone
    as older manifests wrote it). A manifest is untrusted input (a copied or edited checkpoint):
    every entry must name a file inside `path` (not absolute, no `..`, no symbolic link leading
    out), once, with a size; anything else is refused here, at its first read, by ConfigError
    naming the manifest file and the entry, before any file it names is opened."""
    manifest = path / MANIFEST
    try:
        files = json.loads(manifest.read_text(), object_pairs_hook=_refuse_repeated_keys)["files"]
    except ConfigError as exc:
        raise ConfigError(f"{manifest}: {exc}; the file was edited or damaged") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:  # ValueError: bad JSON, not UTF-8
        raise ConfigError(f"{manifest} is unreadable ({exc!r})") from None
    if not isinstance(files, dict):
        raise ConfigError(f'{manifest}: "files" must map each file name to its size and CRC-32, '
                          f"not a {type(files).__name__}; the file was edited or damaged")
    seen: set[str] = set()
    for name, entry in files.items():
        problem = outside(path, name)
        normal = os.path.normpath(name) if problem is None else name
        if problem is None and normal in seen:
            problem = "names a file listed before"
        if problem is None and not (_is_size(entry) or isinstance(entry, dict) and _is_size(entry.get("bytes"))
                                    and isinstance(entry.get("crc32", ""), str)):
            problem = f'needs its "bytes" (and "crc32"), not {entry!r}'
        if problem:
            raise ConfigError(f"{manifest}: entry {name!r} {problem}; the file was edited or damaged")
        seen.add(normal)
    return files


def _is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _refuse_repeated_keys(pairs: list[tuple[str, Any]]) -> dict:
    """json's object_pairs_hook: a key given twice (json would keep the last one silently)."""
    value = dict(pairs)
    if len(value) < len(pairs):
        keys = [key for key, _ in pairs]
        repeated = next(key for index, key in enumerate(keys) if key in keys[:index])
        raise ConfigError(f"entry {repeated!r} is listed twice")
    return value


def write_manifest(directory: Path, known: dict[str, dict] | None = None, **fields: Any) -> dict[str, dict]:
    """MANIFEST.json in `directory`: every file in it with its size and CRC-32, plus `fields` (a
    training checkpoint's step). Written last, once every other file is complete: the manifest
    is what says the directory is whole. Training checkpoints and the outputs of
    `megatron-rl convert` (both directions) carry it; verify()/verify_files() read it. Returns
    the files listed."""
    files = _inventory(directory, known=known)
    _write_json(directory / MANIFEST, {**fields, "checksum": "crc32", "files": files})
    return files


def _inventory(directory: Path, known: dict[str, dict] | None = None) -> dict[str, dict]:
    """{relative path: {"bytes", "crc32"}} of every file but the manifest; `known`: checksums
    computed already (by the ranks that wrote those files)."""
    known = known or {}
    files = {}
    for path in sorted(directory.rglob("*")):
        if not path.is_file() or path.name == MANIFEST:
            continue
        relative = str(path.relative_to(directory))
        entry = known.get(relative)
        if entry is None or entry["bytes"] != path.stat().st_size:
            entry = {"bytes": path.stat().st_size, "crc32": file_crc32(path)}
        files[relative] = entry
    return files


def _write_json(path: Path, value: Any) -> None:
    with open(path, "w") as handle:
        json.dump(value, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
