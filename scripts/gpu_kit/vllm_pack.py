"""The GPU kit's vLLM parts: vLLM 0.26.0 and the wheels it needs, unpacked, its CUDA libraries
pruned to Hopper, compressed, and split into parts that one command each can carry.

    python vllm_pack.py build REQUIREMENTS DOWNLOADS WORK OUT --part-limit-mib 54 [--also STAGE_REQUIREMENTS]

REQUIREMENTS is vllm_requirements.txt (each line ends with its wheel's file name), --also a further
list packed with it (stage_requirements.txt: what the engine stage needs beyond vLLM), DOWNLOADS the
folder holding those wheels, WORK a scratch folder in the cache, OUT the parts' folder
(scripts/gpu_kit/packed_vllm/: part1/, part2/, ... and MANIFEST.md). Each part holds whole
`.tar.xz` chunks and a manifest.json with every file's size and sha256, the set it belongs to and
the names of all the set's parts; vllm_receive.py checks and unpacks them on the GPU machine.

The wheels are unpacked as pip would install them (a .data folder's purelib/platlib at the top;
its scripts, headers and data are left out: nothing on the serve path runs them). Left out of
vLLM itself (DROPPED_FILES): `_vllm_fa2_C` (304.7 MB, sm_80 code only: on Hopper vLLM takes its
bundled FA3), the `vllm-rs` front end (42.8 MB, optional), `third_party/fmha_sm100` (Blackwell
attention sources) and DeepGEMM's modules built for other Pythons than 3.12. Every ELF library
with GPU code is pruned to sm_90 by prune_fatbin.py (`--without-arch-code newest-ptx`) and
checked against the original by its `check` before the original is thrown away.

A second build with the same requirements, wheels and code finds the parts as recorded in
OUT/stamp.json and does nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import shutil
import sys
import tarfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import prune_fatbin  # noqa: E402  (a sibling script, not a package)
from kit import sha256  # noqa: E402
from vllm_receive import verify_part  # noqa: E402

ARCH = 90
DROPPED_FILES = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs", "vllm/third_party/fmha_sm100/")
KEPT_PYTHON_TAG = "cpython-312"  # DeepGEMM ships _C for 3.10-3.14; the GPU machine runs 3.12
MTIME = 1767225600  # 2026-01-01: chunks are byte-identical from one build to the next


def wheels_of(requirements: Path) -> list[str]:
    """The wheel file names, from the `# name.whl` ending of each requirement line."""
    lines = [line for line in requirements.read_text().splitlines() if line.strip() and not line.startswith("#")]
    names = [line.rsplit("# ", 1)[-1].strip() for line in lines]
    bad = [name for name in names if not name.endswith(".whl")]
    if bad:
        raise SystemExit(f"{requirements}: lines without a wheel file name at the end: {bad[:3]}")
    return names


def dropped(member: str) -> bool:
    if any(member == rule or (rule.endswith("/") and member.startswith(rule)) for rule in DROPPED_FILES):
        return True
    return member.startswith("vllm/third_party/deep_gemm/_C.cpython-") and KEPT_PYTHON_TAG not in member


def install_path(member: str) -> str | None:
    """Where pip would put a wheel member (relative to site-packages), or None when left out."""
    top, _, rest = member.partition("/")
    if top.endswith(".data"):
        kind, _, inner = rest.partition("/")
        return inner if kind in ("purelib", "platlib") and inner else None
    return None if dropped(member) else member


def unpack_wheels(downloads: Path, wheels: list[str], site: Path) -> dict[str, list[str]]:
    """Every wheel unpacked into `site`; returns each distribution's files (relative paths)."""
    files: dict[str, list[str]] = {}
    for wheel in wheels:
        distribution = wheel.split("-")[0]
        with zipfile.ZipFile(downloads / wheel) as archive:
            for info in archive.infolist():
                target = install_path(info.filename)
                if target is None or info.is_dir():
                    continue
                path = site / target
                path.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(info) as source, path.open("wb") as out:
                    shutil.copyfileobj(source, out, 1 << 24)
                if (info.external_attr >> 16) & 0o111:
                    path.chmod(0o755)
                files.setdefault(distribution, []).append(target)
    return files


def has_gpu_code(path: Path) -> bool:
    if path.suffix != ".so" and ".so." not in path.name and path.name != "vllm-rs":
        return False
    with path.open("rb") as f:
        if f.read(4) != b"\x7fELF":
            return False
    try:
        prune_fatbin.find_section(path)
    except ValueError:
        return False
    return True


def prune_libraries(site: Path, files: dict[str, list[str]]) -> dict[str, dict]:
    """Prune every library with a .nv_fatbin section in place, each checked against its original."""
    stats = {}
    for relative in sorted(f for names in files.values() for f in names):
        path = site / relative
        if not has_gpu_code(path):
            continue
        pruned = path.with_name(path.name + ".sm_90")
        stats[relative] = prune_fatbin.prune(path, pruned, ARCH, "newest-ptx")
        problems = prune_fatbin.check(path, pruned, ARCH, "newest-ptx")
        if problems:
            raise SystemExit(f"{relative}: the pruned library fails its check: {'; '.join(problems)}")
        stats[relative]["check"] = "every kept sm_90 image and PTX byte-identical to the original's"
        stats[relative]["bytes"] = path.stat().st_size
        pruned.replace(path)
        print(f"vllm_pack: pruned {relative}: {stats[relative]['removed_images']} of {stats[relative]['images']} "
              f"images removed; checked", flush=True)
    return stats


def units_of(files: dict[str, list[str]]) -> dict[str, list[str]]:
    """What is compressed together: one chunk per distribution; vLLM's big libraries and its
    third_party sources each in a chunk of their own, so that the parts can be filled evenly."""
    units: dict[str, list[str]] = {}
    for distribution, names in sorted(files.items()):
        for name in names:
            if distribution == "vllm" and name.endswith(".so"):
                unit = "vllm-" + Path(name).name.split(".")[0].strip("_")
            elif distribution == "vllm" and name.startswith("vllm/third_party/"):
                unit = "vllm-third_party"
            else:
                unit = distribution
            units.setdefault(unit, []).append(name)
    return units


def write_chunk(site: Path, names: list[str], out: Path) -> int:
    """A deterministic tar.xz (xz -6) of `names`: sorted, fixed time and owner. Returns the sum of
    its members' sizes, which the manifest declares so that receiving can refuse an xz bomb."""
    partial = out.with_name(out.name + ".partial")
    unpacked = 0
    with lzma.open(partial, "wb", preset=6) as compressed, tarfile.open(fileobj=compressed, mode="w",
                                                                        format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(names):
            path = site / name
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = path.stat().st_size, MTIME, path.stat().st_mode & 0o755
            with path.open("rb") as f:
                tar.addfile(info, f)
            unpacked += info.size
    partial.replace(out)
    return unpacked


def fill_parts(chunk_sizes: dict[str, int], limit: int) -> list[list[str]]:
    """Chunks into as few parts of at most `limit` bytes as first-fit decreasing finds, then spread
    evenly over that many parts (each next largest chunk into the emptiest part) when that keeps
    every part under the limit: what a command takes along besides the part (the working tree)
    may grow, and even parts leave each command the same margin."""
    ordered = sorted(chunk_sizes.items(), key=lambda item: (-item[1], item[0]))
    parts: list[list[str]] = []
    room: list[int] = []
    for chunk, size in ordered:
        if size > limit:
            raise SystemExit(f"chunk {chunk} is {size} bytes, over the part limit of {limit}")
        slot = next((n for n, left in enumerate(room) if left >= size), None)
        if slot is None:
            parts.append([])
            room.append(limit)
            slot = len(parts) - 1
        parts[slot].append(chunk)
        room[slot] -= size
    even: list[list[str]] = [[] for _ in parts]
    filled = [0] * len(parts)
    for chunk, size in ordered:
        slot = filled.index(min(filled))
        even[slot].append(chunk)
        filled[slot] += size
    return [sorted(part) for part in (even if max(filled) <= limit else parts)]


def write_manifests(out: Path, parts: list[list[str]], chunks: Path, unpacked: dict[str, int],
                    extra: dict) -> list[dict]:
    """Copy each part's chunks into OUT/partN/ and write its manifest.json (each chunk's size,
    sha256 and the sum of its members' sizes, `unpacked`); all share a set id."""
    names = [f"part{n + 1}" for n in range(len(parts))]
    entries = [[{"file": chunk, "bytes": (chunks / chunk).stat().st_size, "sha256": sha256(chunks / chunk),
                 "unpacked_bytes": unpacked[chunk]} for chunk in part] for part in parts]
    set_id = hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()[:16]
    manifests = []
    for name, files in zip(names, entries):
        folder = out / name
        folder.mkdir(parents=True)
        for entry in files:
            shutil.copyfile(chunks / entry["file"], folder / entry["file"])
        manifest = {"set": set_id, "part": name, "parts": names, "bytes": sum(f["bytes"] for f in files),
                    "files": files, **extra}
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        manifests.append(manifest)
    return manifests


def stamp_of(requirements: list[Path], limit: int) -> str:
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in requirements) + str(limit).encode())
    for script in ("vllm_pack.py", "prune_fatbin.py", "vllm_receive.py"):
        digest.update((Path(__file__).parent / script).read_bytes())
    return digest.hexdigest()


def up_to_date(out: Path, stamp: str) -> bool:
    try:
        recorded = json.loads((out / "stamp.json").read_text())
    except (OSError, ValueError):
        return False
    return recorded.get("stamp") == stamp and all(not verify_part(out / name) for name in recorded["parts"])


def build(requirements: list[Path], downloads: Path, work: Path, out: Path, limit: int) -> list[dict]:
    stamp = stamp_of(requirements, limit)
    if up_to_date(out, stamp):
        print(f"vllm_pack: {out} is up to date (stamp.json); nothing to do")
        return [json.loads((out / name / "manifest.json").read_text())
                for name in json.loads((out / "stamp.json").read_text())["parts"]]
    wheels = [wheel for path in requirements for wheel in wheels_of(path)]
    missing = [wheel for wheel in wheels if not (downloads / wheel).exists()]
    if missing:
        raise SystemExit(f"{downloads}: missing {len(missing)} wheels of {', '.join(p.name for p in requirements)}, "
                         f"e.g. {missing[0]}")
    for folder in (work / "site", work / "chunks"):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    site, chunks = work / "site", work / "chunks"
    files = unpack_wheels(downloads, wheels, site)
    prune = prune_libraries(site, files)
    units = units_of(files)
    unpacked = {}
    for n, (unit, names) in enumerate(sorted(units.items())):
        unpacked[f"{unit}.tar.xz"] = write_chunk(site, names, chunks / f"{unit}.tar.xz")
        print(f"vllm_pack: [{n + 1}/{len(units)}] {unit}.tar.xz {(chunks / f'{unit}.tar.xz').stat().st_size / 2**20:.2f} MiB",
              flush=True)
    sizes = {path.name: path.stat().st_size for path in chunks.glob("*.tar.xz")}
    parts = fill_parts(sizes, limit)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    extra = {"vllm": next(w.split("-")[1] for w in wheels if w.startswith("vllm-")), "wheels": len(wheels),
             "set_unpacked_bytes": sum(unpacked.values())}
    manifests = write_manifests(out, parts, chunks, unpacked, extra)
    (out / "prune.json").write_text(json.dumps(prune, indent=1) + "\n")
    write_overview(out, manifests, prune, limit)
    (out / "stamp.json").write_text(json.dumps({"stamp": stamp, "parts": [m["part"] for m in manifests]}) + "\n")
    shutil.rmtree(site)
    return manifests


def write_overview(out: Path, manifests: list[dict], prune: dict, limit: int) -> None:
    total = sum(m["bytes"] for m in manifests)
    lines = [f"# GPU kit, vLLM parts: {total / 2**20:.1f} MiB in {len(manifests)} parts of at most "
             f"{limit / 2**20:.0f} MiB (set {manifests[0]['set']})", "",
             "| part | chunks | MiB |", "| --- | --- | --- |"]
    lines += [f"| {m['part']} | {len(m['files'])} | {m['bytes'] / 2**20:.2f} |" for m in manifests]
    lines += ["", "| library (pruned to sm_90, checked) | MB | fat binaries | without sm_90 code | kept as PTX | images removed |",
              "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {name} | {s['bytes'] / 1e6:.1f} | {s['fatbins']} | {s['fatbins_without_sm_code']} | "
              f"{s['fatbins_kept_as_ptx_only']} | {s['removed_images']} of {s['images']} |" for name, s in prune.items()]
    (out / "MANIFEST.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["build"])
    for name in ("requirements", "downloads", "work", "out"):
        parser.add_argument(name, type=Path)
    parser.add_argument("--part-limit-mib", type=float, default=54)
    parser.add_argument("--also", type=Path, action="append", default=[], help="a further requirements list")
    args = parser.parse_args(argv)
    manifests = build([args.requirements, *args.also], args.downloads, args.work, args.out, int(args.part_limit_mib * 2**20))
    for m in manifests:
        print(f"vllm_pack: {args.out / m['part']}: {m['bytes']} bytes ({m['bytes'] / 2**20:.2f} MiB), {len(m['files'])} chunks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
