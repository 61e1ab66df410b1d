"""The GPU kit's file steps on small synthetic inputs: the fat-binary pruning (scripts/gpu_kit/
prune_fatbin.py) and the core wheel taken apart and put together again (scripts/gpu_kit/kit.py).
The real library (463 MB) is pruned and checked by pack.sh itself; these pin the format handling."""

import importlib.util
import lzma
import os
import struct
import subprocess
import sys
import zipfile

import pytest

from _support.processes import REPO


def load(name, file):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / "gpu_kit" / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


prune_fatbin, kit = load("gpu_kit_prune_fatbin", "prune_fatbin.py"), load("gpu_kit_kit", "kit.py")


def image(kind: int, arch: int, payload: bytes) -> bytes:
    """An image header as nvcc writes it (64 bytes: kind, version, header size, payload size, ...,
    arch at byte 28), then the payload."""
    header = bytearray(64)
    struct.pack_into("<HHIQ", header, 0, kind, 0x0101, 64, len(payload))
    struct.pack_into("<I", header, 28, arch)
    return bytes(header) + payload


def fatbin(*images: bytes) -> bytes:
    body = b"".join(images)
    blob = struct.pack("<IHHQ", prune_fatbin.FATBIN_MAGIC, 1, 16, len(body)) + body
    return blob + bytes(-len(blob) % 8)


def section_of(*fatbins: bytes) -> bytes:
    return b"".join(fatbins)


def test_each_fat_binary_keeps_exactly_its_sm90_images_in_place():
    first = fatbin(image(1, 80, b"ptx80" * 9), image(2, 80, b"elf80" * 7), image(2, 90, b"ELF90" * 5),
                   image(1, 90, b"PTX90" * 3), image(2, 100, b"elf100" * 11))
    second = fatbin(image(2, 75, b"a" * 40), image(2, 90, b"B" * 24))
    section = section_of(first, second)
    pruned, stats = prune_fatbin.pruned_section(section, 90)

    assert len(pruned) == len(section)
    assert pruned[len(first):len(first) + 4] == section[len(first):len(first) + 4]  # the second stays where it was
    fatbins = prune_fatbin.parse_fatbins(pruned)
    assert [fb.start for fb in fatbins] == [0, len(first)]
    kept = [[(i.kind, i.arch, pruned[i.start:i.start + i.size]) for i in fb.images] for fb in fatbins]
    assert kept == [[("elf", 90, image(2, 90, b"ELF90" * 5)), ("ptx", 90, image(1, 90, b"PTX90" * 3))],
                    [("elf", 90, image(2, 90, b"B" * 24))]]
    assert pruned[fatbins[0].end:len(first)].count(0) == len(first) - fatbins[0].end  # the freed tail is zeros
    assert stats["removed_images"] == 4 and stats["fatbins_left_whole"] == []
    assert stats["kept_bytes"] == {"elf_90": 25 + 24, "ptx_90": 15}


def test_a_fat_binary_without_sm90_machine_code_is_left_whole():
    only_ptx = fatbin(image(1, 90, b"p" * 16), image(2, 80, b"e" * 16))
    section = section_of(fatbin(image(2, 90, b"x" * 8)), only_ptx)
    pruned, stats = prune_fatbin.pruned_section(section, 90)
    assert pruned == section and stats["fatbins_left_whole"] == [1]


def test_a_section_in_another_format_is_refused():
    bad = bytearray(fatbin(image(2, 90, b"x" * 8)))
    bad[0] ^= 0xFF
    with pytest.raises(ValueError, match="magic"):
        prune_fatbin.parse_fatbins(bytes(bad))
    short = bytearray(fatbin(image(2, 90, b"x" * 8)))
    struct.pack_into("<Q", short, 8, 70)  # the header's size no longer ends at an image boundary
    with pytest.raises(ValueError, match="images end at"):
        prune_fatbin.parse_fatbins(bytes(short))


def make_core_wheel(path, library: bytes):
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("transformer_engine/__init__.py", "")
        wheel.writestr(kit.LIBRARY, library)
        wheel.writestr("transformer_engine_cu13-2.11.0.dist-info/RECORD",
                       f"transformer_engine/__init__.py,,0\n{kit.LIBRARY},sha256=old,{len(library)}\n"
                       "transformer_engine_cu13-2.11.0.dist-info/RECORD,,\n")


def test_the_core_wheel_comes_apart_and_back_with_its_record_naming_the_pruned_library(tmp_path):
    make_core_wheel(tmp_path / "core.whl", b"original library")
    kit.split_core(tmp_path / "core.whl", tmp_path / "lib.so", tmp_path / "stripped.whl")
    assert (tmp_path / "lib.so").read_bytes() == b"original library"
    assert kit.LIBRARY not in zipfile.ZipFile(tmp_path / "stripped.whl").namelist()

    (tmp_path / "pruned.so").write_bytes(b"pruned library")
    kit.set_library_record(tmp_path / "stripped.whl", tmp_path / "pruned.so")
    kit.pack_lib(tmp_path / "pruned.so", tmp_path / "lib.so.xz")
    kit.assemble_core(tmp_path / "stripped.whl", tmp_path / "lib.so.xz", tmp_path / "whole.whl")
    whole = zipfile.ZipFile(tmp_path / "whole.whl")
    assert whole.read(kit.LIBRARY) == b"pruned library"
    record = whole.read("transformer_engine_cu13-2.11.0.dist-info/RECORD").decode()
    assert f"{kit.LIBRARY},{kit.record_hash(tmp_path / 'pruned.so')},14" in record.splitlines()

    # A compressed library that is not the one the RECORD names is refused, and no wheel is left.
    (tmp_path / "whole.whl").unlink()
    (tmp_path / "lib.so.xz").write_bytes(lzma.compress(b"another library"))
    with pytest.raises(SystemExit, match="pack the kit again"):
        kit.assemble_core(tmp_path / "stripped.whl", tmp_path / "lib.so.xz", tmp_path / "whole.whl")
    assert list(tmp_path.glob("whole.whl*")) == []


def test_verify_names_a_changed_or_missing_file(tmp_path):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "a-1.0-py3-none-any.whl").write_bytes(b"a")
    (tmp_path / "b.txt").write_bytes(b"b")
    (tmp_path / "prune.json").write_text('{"arch": 90, "fatbins": 1, "images": 2, "removed_images": 1, '
                                         '"removed_bytes": 8, "kept_bytes": {"elf_90": 8}, "fatbins_left_whole": []}')
    prune_json = tmp_path / "prune.json"
    packed = tmp_path
    manifest = kit.write_manifest(packed, prune_json)
    assert {f["file"]: f["package"] for f in manifest["files"]}["wheels/a-1.0-py3-none-any.whl"] == "a"
    assert kit.verify(packed) == []
    (tmp_path / "b.txt").write_bytes(b"B")
    (tmp_path / "wheels" / "a-1.0-py3-none-any.whl").unlink()
    assert kit.verify(packed) == ["b.txt: differs from the manifest", "wheels/a-1.0-py3-none-any.whl: missing"]


STUB_PIP = """#!/usr/bin/env bash
# Stands in for `python PIP_WHEEL/pip install ... --target DIR SOURCE` (the real build needs nvcc):
# lays out what TE's setup.py installs: the module inside transformer_engine/wheel_lib/, the
# .dist-info at the top. STUB_MODULE=none leaves the module out.
while [[ $# -gt 0 && $1 != --target ]]; do shift; done
target=$2
mkdir -p "$target/transformer_engine/wheel_lib" "$target/transformer_engine_torch-2.11.0.dist-info"
touch "$target/transformer_engine_torch-2.11.0.dist-info/RECORD"
[[ ${STUB_MODULE:-} == none ]] || echo built > "$target/transformer_engine/wheel_lib/transformer_engine_torch.cpython-312-x86_64-linux-gnu.so"
"""


@pytest.mark.parametrize("module_built", [True, False])
def test_the_built_extension_lands_in_te_wheel_lib_with_a_stub_pip(tmp_path, module_built):
    """build_te_torch.sh with a stub for pip (named so: the real build needs CUDA): the module must
    end up in the installed TE's wheel_lib/, beside the core library that is already there, or the
    build fails by name. The first GPU run moved only the .dist-info and TE could not load."""
    stub = tmp_path / "python"
    stub.write_text(STUB_PIP)
    stub.chmod(0o755)
    te_site = tmp_path / "te"
    (te_site / "transformer_engine" / "wheel_lib").mkdir(parents=True)
    (te_site / "transformer_engine" / "wheel_lib" / "libtransformer_engine.so").write_text("core")
    rc_file = tmp_path / "te_build.rc"
    env = dict(os.environ, STUB_MODULE="" if module_built else "none")
    result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_kit" / "build_te_torch.sh"), str(stub),
                             str(tmp_path / "pipwheel"), str(tmp_path / "source"), str(te_site), str(rc_file)],
                            capture_output=True, text=True, env=env)
    wheel_lib = te_site / "transformer_engine" / "wheel_lib"
    assert (wheel_lib / "libtransformer_engine.so").read_text() == "core"
    if module_built:
        assert result.returncode == 0 and rc_file.read_text().strip() == "0", result.stdout + result.stderr
        assert (wheel_lib / "transformer_engine_torch.cpython-312-x86_64-linux-gnu.so").read_text() == "built\n"
        assert (te_site / "transformer_engine_torch-2.11.0.dist-info" / "RECORD").exists()
    else:
        assert result.returncode != 0 and rc_file.read_text().strip() != "0"
        assert "no transformer_engine_torch*.so" in result.stdout
