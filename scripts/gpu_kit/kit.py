"""The GPU kit's file steps, shared by pack.sh (on a CPU machine) and run.sh (on the GPU machine).

    python kit.py split-core WHEEL LIB_OUT STRIPPED_WHEEL_OUT   # the core wheel without its library
    python kit.py pack-lib LIB XZ_OUT                           # xz -6 (cached: skipped when done)
    python kit.py assemble-core STRIPPED_WHEEL LIB_XZ WHEEL_OUT # the wheel again, pruned library inside
    python kit.py record-library STRIPPED_WHEEL LIB             # its RECORD names the pruned library
    python kit.py manifest PACKED_DIR PRUNE_JSON                # manifest.json + MANIFEST.md
    python kit.py verify PACKED_DIR                             # every file against manifest.json

Transformer Engine's core wheel (transformer_engine_cu13) is 179 MB, almost all of it one library;
the kit carries that library pruned to Hopper's code and xz-compressed, and the rest of the wheel
as a wheel of its own. On the GPU machine `assemble-core` puts the two back together into a
complete wheel (its RECORD already names the pruned library's hash and size), so pip installs the
core package like any other, with its metadata, which Transformer Engine checks at import.
Standard library only: it runs under the GPU machine's bare Python.
"""

from __future__ import annotations

import base64
import hashlib
import json
import lzma
import shutil
import sys
import time
import zipfile
from pathlib import Path

LIBRARY = "transformer_engine/wheel_lib/libtransformer_engine.so"
CHUNK = 1 << 24


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def record_hash(path: Path) -> str:
    """A wheel RECORD's hash field: sha256, urlsafe base64 without padding."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return "sha256=" + base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()


def split_core(wheel: Path, library_out: Path, stripped_out: Path) -> None:
    """Extract the core library; write the wheel without it (compressed again, as wheels are)."""
    with zipfile.ZipFile(wheel) as source:
        with source.open(LIBRARY) as member, library_out.open("wb") as out:
            shutil.copyfileobj(member, out, CHUNK)
        with zipfile.ZipFile(stripped_out, "w", zipfile.ZIP_DEFLATED) as stripped:
            for info in source.infolist():
                if info.filename != LIBRARY:
                    stripped.writestr(info, source.read(info), zipfile.ZIP_DEFLATED)


def set_library_record(stripped: Path, library: Path) -> None:
    """Rewrite the stripped wheel's RECORD line for the library: the pruned file's hash and size."""
    with zipfile.ZipFile(stripped) as source:
        infos = [(info, source.read(info)) for info in source.infolist()]
    record_name = next(info.filename for info, _ in infos if info.filename.endswith(".dist-info/RECORD"))
    line = f"{LIBRARY},{record_hash(library)},{library.stat().st_size}"
    partial = stripped.with_name(stripped.name + ".partial")
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as out:
        for info, data in infos:
            if info.filename == record_name:
                rows = [row for row in data.decode().splitlines() if not row.startswith(LIBRARY + ",")]
                data = "\n".join(rows[:-1] + [line] + rows[-1:]).encode() + b"\n" if rows else data
            out.writestr(info, data, zipfile.ZIP_DEFLATED)
    partial.replace(stripped)


def pack_lib(library: Path, xz_out: Path) -> None:
    """xz -6 of the pruned library; the freed bytes are zeros, so this is where the size goes."""
    partial = xz_out.with_name(xz_out.name + ".partial")
    with library.open("rb") as source, lzma.open(partial, "wb", preset=6) as out:
        shutil.copyfileobj(source, out, CHUNK)
    partial.replace(xz_out)


def library_record(stripped: Path) -> str:
    """The RECORD hash field the stripped wheel holds for the library (set_library_record wrote it)."""
    with zipfile.ZipFile(stripped) as wheel:
        record = next(name for name in wheel.namelist() if name.endswith(".dist-info/RECORD"))
        rows = [row.split(",") for row in wheel.read(record).decode().splitlines()]
    return next(row[1] for row in rows if row[0] == LIBRARY)


class _Hashing:
    """A writable file that hashes what passes through it on the way to another."""

    def __init__(self, target):
        self.target, self.digest = target, hashlib.sha256()

    def write(self, data) -> int:
        self.digest.update(data)
        return self.target.write(data)


def assemble_core(stripped: Path, library_xz: Path, wheel_out: Path) -> float:
    """The complete core wheel: the stripped wheel's members plus the library, decompressed into
    it uncompressed (pip unpacks it at disk speed), and checked against the hash the wheel's RECORD
    names for it. Returns the seconds the restore took."""
    started = time.perf_counter()
    partial = wheel_out.with_name(wheel_out.name + ".partial")
    shutil.copyfile(stripped, partial)
    with zipfile.ZipFile(partial, "a", zipfile.ZIP_STORED) as out, lzma.open(library_xz, "rb") as library:
        info = zipfile.ZipInfo(LIBRARY, date_time=(2026, 1, 1, 0, 0, 0))
        info.external_attr = 0o755 << 16
        with out.open(info, "w", force_zip64=True) as member:
            hashing = _Hashing(member)
            shutil.copyfileobj(library, hashing, CHUNK)
    restored = "sha256=" + base64.urlsafe_b64encode(hashing.digest.digest()).rstrip(b"=").decode()
    if restored != library_record(stripped):
        partial.unlink()
        raise SystemExit(f"{library_xz} restores to a library whose hash ({restored}) is not the one the "
                         f"wheel's RECORD names ({library_record(stripped)}): pack the kit again")
    partial.replace(wheel_out)
    return time.perf_counter() - started


def package_of(path: Path) -> tuple[str, str]:
    """(package, version) from a wheel's or sdist's file name (name-version-...), else ("", "")."""
    if path.name == "libtransformer_engine.so.xz":
        core = next(path.parent.glob("transformer_engine_cu13-*.whl"), None)
        return "transformer_engine_cu13's library, sm_90 only", core.name.split("-")[1] if core else ""
    name = path.name.removesuffix(".tar.gz").removesuffix(".whl")
    parts = name.split("-")
    return (parts[0], parts[1]) if len(parts) >= 2 and path.name.endswith((".whl", ".tar.gz")) else ("", "")


def write_manifest(packed: Path, prune_json: Path) -> dict:
    """manifest.json (what verify checks) and MANIFEST.md (for people) of every file in `packed`."""
    files = []
    for path in sorted(p for p in packed.rglob("*") if p.is_file() and p.name not in ("manifest.json", "MANIFEST.md")):
        package, version = package_of(path)
        files.append({"file": str(path.relative_to(packed)), "package": package, "version": version,
                      "bytes": path.stat().st_size, "sha256": sha256(path)})
    manifest = {"total_bytes": sum(f["bytes"] for f in files), "files": files,
                "prune": json.loads(prune_json.read_text())}
    (packed / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    prune = manifest["prune"]
    lines = [f"# GPU kit: {manifest['total_bytes'] / 2**20:.1f} MiB in {len(files)} files", "",
             "| file | package | version | MiB | sha256 |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {f['file']} | {f['package']} | {f['version']} | {f['bytes'] / 2**20:.2f} | {f['sha256'][:16]}... |"
              for f in files]
    lines += ["", f"Core library ({LIBRARY}) pruned to sm_{prune['arch']}: {prune['removed_images']} of "
              f"{prune['images']} images in {prune['fatbins']} fat binaries removed ({prune['removed_bytes'] / 1e6:.0f} MB); "
              "kept: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in prune["kept_bytes"].items())
              + f"; fat binaries left whole: {prune['fatbins_left_whole'] or 'none'}."]
    (packed / "MANIFEST.md").write_text("\n".join(lines) + "\n")
    return manifest


def verify(packed: Path) -> list[str]:
    """Files that are missing or differ from manifest.json (empty: the kit is as packed)."""
    manifest_path = packed / "manifest.json"
    if not manifest_path.exists():
        return [f"{manifest_path} is missing: run scripts/gpu_kit/pack.sh"]
    problems = []
    for entry in json.loads(manifest_path.read_text())["files"]:
        path = packed / entry["file"]
        if not path.exists():
            problems.append(f"{entry['file']}: missing")
        elif path.stat().st_size != entry["bytes"] or sha256(path) != entry["sha256"]:
            problems.append(f"{entry['file']}: differs from the manifest")
    return problems


def main(argv: list[str]) -> int:
    command, *args = argv
    paths = [Path(a) for a in args]
    if command == "split-core":
        split_core(*paths)
    elif command == "record-library":
        set_library_record(*paths)
    elif command == "pack-lib":
        pack_lib(*paths)
    elif command == "assemble-core":
        print(f"core library restored into {paths[2].name} in {assemble_core(*paths):.1f} s")
    elif command == "manifest":
        manifest = write_manifest(*paths)
        print(f"manifest: {len(manifest['files'])} files, {manifest['total_bytes'] / 2**20:.1f} MiB")
    elif command == "verify":
        problems = verify(paths[0])
        print("\n".join(problems) or f"{paths[0]}: every file as in its manifest")
        return 1 if problems else 0
    else:
        print(f"unknown command {command!r}; see the docstring of {__file__}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
