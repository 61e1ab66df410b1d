"""Keep one GPU architecture's code in a CUDA shared library: remove the other architectures' images.

    python prune_fatbin.py list LIB                       # every fat binary's images: kind, arch, size
    python prune_fatbin.py prune LIB OUT --arch 90 [--json STATS] [--without-arch-code newest-ptx]
    python prune_fatbin.py check LIB OUT --arch 90 [--without-arch-code newest-ptx]   # OUT is exactly LIB pruned so

Why: Transformer Engine's core library (libtransformer_engine.so, 463 MB) carries GPU code for seven
architectures; a Hopper GPU runs only sm_90 machine code. Removing the other images inside the
.nv_fatbin section, in place, keeps every offset, symbol and relocation of the library as it was,
so the host code and the loader see the same file, while the freed bytes (zeros) compress to
almost nothing.

The format (as nvcc writes it and as cuobjdump reads it; every field used here is checked against
the file: the walk must end exactly at each fat binary's declared size, or nothing is written):

    ELF section .nv_fatbin: fat binaries one after the other, each 8-byte aligned
    fat binary header (16 bytes): magic 0xBA55ED50 (u32), version (u16), header size (u16),
                                  size of the images that follow (u64)
    image header: kind (u16: 1 PTX, 2 ELF machine code), version (u16), header size (u32),
                  payload size (u64), ... arch at byte 28 (u32: 90 for sm_90 and sm_90a)
    payload: the image (zstd-compressed when nvcc compressed it), then the next image header

Each fat binary keeps its place (the host code registers it by its address, in .nvFatBinSegment)
and is compacted: its header's size shrinks to the kept images, which follow it back to back as
nvcc writes them for one architecture, and the bytes freed behind them are zero (nothing points
there). The driver reads a fat binary from its header on, so it finds an sm_90-only fat binary;
cuobjdump reads the result too. (Zeroing the other images' payloads in place, headers kept, was
tried first: cuobjdump then fails with "Uncompress failed", since most images are zstd-compressed
and it decompresses each one it lists.) A fat binary with no machine code for the kept
architecture is left whole by default (its PTX would be the GPU's only code for it). With
`--without-arch-code newest-ptx` (vLLM's libraries, whose Marlin and sm_100/sm_120 kernels have no
sm_90 machine code) it keeps only what the driver would use on that GPU: its newest PTX at an
architecture <= the kept one, which the driver compiles for the GPU. A fat binary with neither (code
only for newer GPUs, unusable on the kept one before and after) keeps its smallest image, so that
it stays a well-formed fat binary that simply has no code for this GPU, as the original had.
That the pruned library loads and runs on a GPU is shown only on a GPU (benchmarks/gpu_verify.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
FATBIN_HEADER = struct.Struct("<IHHQ")  # magic, version, header size, images' size
IMAGE_HEADER = struct.Struct("<HHIQ")  # kind, version, header size, payload size
ARCH_OFFSET = 28  # u32 in the image header
KINDS = {1: "ptx", 2: "elf"}
SECTION = ".nv_fatbin"


@dataclass(frozen=True)
class Image:
    kind: str  # "ptx" or "elf"
    arch: int  # 90 = sm_90 / compute_90 (sm_90a too)
    start: int  # the image header's offset in the section
    size: int  # header and payload
    payload_size: int


@dataclass(frozen=True)
class Fatbin:
    start: int  # offset in the section
    header_size: int
    images: tuple[Image, ...]

    @property
    def end(self) -> int:
        return self.start + self.header_size + sum(image.size for image in self.images)


def find_section(path: Path, name: str = SECTION) -> tuple[int, int]:
    """(file offset, size) of an ELF64 little-endian section, read from the section headers."""
    with path.open("rb") as f:
        ident = f.read(64)
        if ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
            raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
        shoff, = struct.unpack_from("<Q", ident, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", ident, 0x3A)
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        headers = [struct.unpack_from("<IIQQQQIIQQ", table, i * shentsize) for i in range(shnum)]
        names_offset, names_size = headers[shstrndx][4], headers[shstrndx][5]
        f.seek(names_offset)
        names = f.read(names_size)
    for header in headers:
        start = header[0]
        if names[start:names.index(b"\0", start)].decode() == name:
            return header[4], header[5]
    raise ValueError(f"{path}: no {name} section (not a library with CUDA device code)")


def read_section(path: Path) -> bytes:
    offset, size = find_section(path)
    with path.open("rb") as f:
        f.seek(offset)
        return f.read(size)


def parse_fatbins(section: bytes, where: str = SECTION) -> list[Fatbin]:
    """Every fat binary and its images, validated as the section is walked."""
    fatbins, position = [], 0
    while position < len(section):
        magic, _, header_size, images_size = FATBIN_HEADER.unpack_from(section, position)
        if magic != FATBIN_MAGIC:
            raise ValueError(f"{where}: fat binary {len(fatbins)} at section offset {position} has magic "
                             f"{magic:#x}, expected {FATBIN_MAGIC:#x}; not the format this tool knows")
        cursor, end = position + header_size, position + header_size + images_size
        images = []
        while cursor < end:
            kind, _, image_header_size, payload_size = IMAGE_HEADER.unpack_from(section, cursor)
            arch, = struct.unpack_from("<I", section, cursor + ARCH_OFFSET)
            if kind not in KINDS or image_header_size < ARCH_OFFSET + 4:
                raise ValueError(f"{where}: fat binary {len(fatbins)} has an image of unknown kind {kind}")
            images.append(Image(KINDS[kind], arch, cursor, image_header_size + payload_size, payload_size))
            cursor += image_header_size + payload_size
        if cursor != end:
            raise ValueError(f"{where}: fat binary {len(fatbins)}'s images end at {cursor}, its header says {end}")
        fatbins.append(Fatbin(position, header_size, tuple(images)))
        position = end + (-end % 8)
        # The freed tail of a fat binary compacted by this tool is zeros: skip to the next header.
        while position < len(section) and section[position:position + 4] == b"\0\0\0\0":
            position += 8
    return fatbins


WITHOUT_ARCH_CODE = ("whole", "newest-ptx")


def kept_images(fatbin: Fatbin, arch: int, without_arch_code: str = "whole") -> tuple[Image, ...]:
    """`arch`'s images; when the fat binary has no `arch` machine code, all of them ("whole") or
    its newest PTX at an architecture <= `arch`, else its smallest image ("newest-ptx")."""
    if any(image.kind == "elf" and image.arch == arch for image in fatbin.images):
        return tuple(image for image in fatbin.images if image.arch == arch)
    if without_arch_code == "whole":
        return fatbin.images
    ptx = [image for image in fatbin.images if image.kind == "ptx" and image.arch <= arch]
    if ptx:
        newest = max(image.arch for image in ptx)
        return tuple(image for image in ptx if image.arch == newest)
    return (min(fatbin.images, key=lambda image: image.size),)


def pruned_section(section: bytes, arch: int, without_arch_code: str = "whole") -> tuple[bytes, dict]:
    """The section with every fat binary compacted to its kept images (see the module docstring)."""
    fatbins = parse_fatbins(section)
    out = bytearray(section)
    for fatbin in fatbins:
        kept = kept_images(fatbin, arch, without_arch_code)
        body = b"".join(section[image.start:image.start + image.size] for image in kept)
        struct.pack_into("<Q", out, fatbin.start + 8, len(body))
        first = fatbin.start + fatbin.header_size
        out[first:fatbin.end] = body + bytes(fatbin.end - first - len(body))
    return bytes(out), summary(section, fatbins, arch, without_arch_code)


def summary(section: bytes, fatbins: list[Fatbin], arch: int, without_arch_code: str = "whole") -> dict:
    every = [image for fatbin in fatbins for image in fatbin.images]
    kept = [image for fatbin in fatbins for image in kept_images(fatbin, arch, without_arch_code)]
    without = [(n, fatbin) for n, fatbin in enumerate(fatbins)
               if not any(image.kind == "elf" and image.arch == arch for image in fatbin.images)]
    return {
        "arch": arch,
        "fatbins": len(fatbins),
        "images": len(every),
        "removed_images": len(every) - len(kept),
        "removed_bytes": sum(image.size for image in every) - sum(image.size for image in kept),
        "kept_bytes": {f"{kind}_{a}": sum(i.payload_size for i in kept if (i.kind, i.arch) == (kind, a))
                       for kind, a in sorted({(i.kind, i.arch) for i in kept})},
        "fatbins_left_whole": [n for n, fatbin in enumerate(fatbins)
                               if kept_images(fatbin, arch, without_arch_code) == fatbin.images
                               and any(image.arch != arch for image in fatbin.images)],
        "without_arch_code": without_arch_code,
        "fatbins_without_sm_code": len(without),
        "fatbins_kept_as_ptx_only": sum(all(i.kind == "ptx" for i in kept_images(f, arch, without_arch_code))
                                        for _, f in without),
    }


def prune(source: Path, target: Path, arch: int, without_arch_code: str = "whole") -> dict:
    """Write `target`: `source` with each fat binary holding only `arch`'s images. Returns the counts."""
    offset, _ = find_section(source)
    section, stats = pruned_section(read_section(source), arch, without_arch_code)
    partial = target.with_name(target.name + ".partial")
    shutil.copyfile(source, partial)
    with partial.open("r+b") as f:
        f.seek(offset)
        f.write(section)
    partial.replace(target)  # a killed run leaves no half-pruned library under the real name
    return stats


def check(source: Path, target: Path, arch: int, without_arch_code: str = "whole") -> list[str]:
    """What differs between `target` and `source` pruned to `arch` (empty: it is exactly that):
    the same bytes outside .nv_fatbin, and each fat binary holding exactly the source's kept
    images, byte for byte, in their order."""
    if source.stat().st_size != target.stat().st_size:
        return [f"sizes differ: {source.stat().st_size} vs {target.stat().st_size}"]
    offset, size = find_section(source)
    problems = []
    with source.open("rb") as a, target.open("rb") as b:
        for start, length in ((0, offset), (offset + size, source.stat().st_size - offset - size)):
            if _digest(a, start, length) != _digest(b, start, length):
                problems.append(f"bytes {start}..{start + length} outside {SECTION} differ")
    original, pruned = read_section(source), read_section(target)
    wanted = [[original[i.start:i.start + i.size] for i in kept_images(f, arch, without_arch_code)]
              for f in parse_fatbins(original)]
    found = [[pruned[i.start:i.start + i.size] for i in f.images] for f in parse_fatbins(pruned, str(target))]
    if wanted != found:
        problems.append(f"the fat binaries do not hold exactly the source's sm_{arch} images"
                        + (" and newest PTX" if without_arch_code == "newest-ptx" else ""))
    return problems


def _digest(f, offset: int, size: int) -> str:
    f.seek(offset)
    digest = hashlib.sha256()
    while size > 0:
        chunk = f.read(min(size, 1 << 24))
        digest.update(chunk)
        size -= len(chunk)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list")
    listing.add_argument("library", type=Path)
    pruning = commands.add_parser("prune")
    checking = commands.add_parser("check")
    for sub in (pruning, checking):
        sub.add_argument("library", type=Path)
        sub.add_argument("out", type=Path)
        sub.add_argument("--arch", type=int, default=90, help="the architecture to keep (90: Hopper)")
        sub.add_argument("--without-arch-code", choices=WITHOUT_ARCH_CODE, default="whole",
                         help="a fat binary without the architecture's machine code: left whole, or its newest PTX")
    pruning.add_argument("--json", type=Path, help="write the counts here as well")
    args = parser.parse_args(argv)
    if args.command == "list":
        for index, fatbin in enumerate(parse_fatbins(read_section(args.library), str(args.library))):
            for image in fatbin.images:
                print(f"fatbin {index:3d}  {image.kind}  sm_{image.arch:<4d} {image.payload_size:>10d} bytes")
        return 0
    if args.command == "check":
        problems = check(args.library, args.out, args.arch, args.without_arch_code)
        print("\n".join(problems) or f"{args.out}: exactly {args.library} with each fat binary compacted to sm_{args.arch}")
        return 1 if problems else 0
    stats = prune(args.library, args.out, args.arch, args.without_arch_code)
    print(json.dumps(stats, indent=1))
    if args.json:
        args.json.write_text(json.dumps(stats, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
