"""The GPU kit's vLLM parts on small fake inputs: the strict pruning (newest PTX where a fat
binary has no sm_90 machine code) and its check on a fake ELF library; the parts filled and their
manifests written (scripts/gpu_kit/vllm_pack.py); a fake part set received over several calls of
`run.sh --receive`, a missing or corrupted part refused by name, and `run.sh --engine` refusing
until every part is there (scripts/gpu_kit/vllm_receive.py). The real parts (vLLM 0.26.0, about
148 MiB in three parts) are built and checked by pack.sh itself; these pin the logic."""

import importlib.util
import io
import json
import lzma
import os
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from _support.processes import REPO



def load(name, file):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / "gpu_kit" / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module

prune_fatbin = load("gpu_kit_prune_fatbin", "prune_fatbin.py")
vllm_receive = load("vllm_receive", "vllm_receive.py")  # vllm_pack imports it by this name
vllm_pack = load("gpu_kit_vllm_pack", "vllm_pack.py")
RUN = REPO / "scripts" / "gpu_kit" / "run.sh"


def image(kind: int, arch: int, payload: bytes) -> bytes:
    """An image header as nvcc writes it (kind, version, header size 64, payload size, arch at byte 28)."""
    header = bytearray(64)
    struct.pack_into("<HHIQ", header, 0, kind, 0x0101, 64, len(payload))
    struct.pack_into("<I", header, 28, arch)
    return bytes(header) + payload


def fatbin(*images: bytes) -> bytes:
    body = b"".join(images)
    blob = struct.pack("<IHHQ", prune_fatbin.FATBIN_MAGIC, 1, 16, len(body)) + body
    return blob + bytes(-len(blob) % 8)


def fake_elf(path: Path, section: bytes, before: bytes = b"host code", after: bytes = b"more host code") -> None:
    """A fake 64-bit ELF library: header, host bytes, the .nv_fatbin section, host bytes, the
    section-name table and three section headers (null, .nv_fatbin, .shstrtab): what the pruner reads."""
    names = b"\0.nv_fatbin\0.shstrtab\0"
    fat_offset = 64 + len(before)
    names_offset = fat_offset + len(section) + len(after)
    shoff = names_offset + len(names)
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, 3, 2)

    def section_header(name: int, offset: int, size: int) -> bytes:
        return struct.pack("<IIQQQQIIQQ", name, 1, 0, 0, offset, size, 0, 0, 1, 0)

    path.write_bytes(bytes(header) + before + section + after + names + bytes(64)
                     + section_header(1, fat_offset, len(section)) + section_header(12, names_offset, len(names)))


def test_without_sm90_machine_code_only_the_newest_ptx_up_to_sm90_is_kept_and_check_proves_it(tmp_path):
    with_sm90 = fatbin(image(2, 80, b"e80" * 9), image(2, 90, b"E90" * 5), image(1, 90, b"P90" * 3))
    marlin = fatbin(image(2, 80, b"m80" * 20), image(1, 75, b"p75" * 4), image(1, 80, b"p80" * 6),
                    image(2, 100, b"m100" * 7), image(1, 100, b"p100" * 5))
    blackwell_only = fatbin(image(2, 100, b"b" * 64), image(2, 120, b"c" * 24))
    section = with_sm90 + marlin + blackwell_only
    fake_elf(tmp_path / "lib.so", section)

    stats = prune_fatbin.prune(tmp_path / "lib.so", tmp_path / "pruned.so", 90, "newest-ptx")
    pruned = prune_fatbin.read_section(tmp_path / "pruned.so")
    kept = [[pruned[i.start:i.start + i.size] for i in f.images] for f in prune_fatbin.parse_fatbins(pruned)]
    assert kept == [[image(2, 90, b"E90" * 5), image(1, 90, b"P90" * 3)],
                    [image(1, 80, b"p80" * 6)],  # compute_80 PTX: the driver compiles it for sm_90
                    [image(2, 120, b"c" * 24)]]  # nothing here runs on sm_90: the smallest image, well-formed
    assert (stats["fatbins_without_sm_code"], stats["fatbins_kept_as_ptx_only"]) == (2, 1)
    assert prune_fatbin.check(tmp_path / "lib.so", tmp_path / "pruned.so", 90, "newest-ptx") == []
    # The default (TE's core library) leaves such fat binaries whole: the same file is not that.
    assert prune_fatbin.check(tmp_path / "lib.so", tmp_path / "pruned.so", 90) != []

    # One byte of the kept PTX changed: the check names it; one host byte changed: it names that.
    data = bytearray((tmp_path / "pruned.so").read_bytes())
    ptx_at = data.index(b"p80" * 6)
    data[ptx_at] ^= 1
    (tmp_path / "bad.so").write_bytes(bytes(data))
    assert prune_fatbin.check(tmp_path / "lib.so", tmp_path / "bad.so", 90, "newest-ptx") == \
        ["the fat binaries do not hold exactly the source's sm_90 images and newest PTX"]
    data[ptx_at] ^= 1
    data[64] ^= 1
    (tmp_path / "bad.so").write_bytes(bytes(data))
    assert "outside .nv_fatbin differ" in prune_fatbin.check(tmp_path / "lib.so", tmp_path / "bad.so", 90, "newest-ptx")[0]


def test_parts_are_filled_evenly_under_the_limit_and_the_dropped_files_never_unpacked():
    # First-fit decreasing needs three parts ([a e] [b c] [d]); spread evenly over three: 50, 35, 45.
    parts = vllm_pack.fill_parts({"a": 50, "b": 30, "c": 25, "d": 20, "e": 5}, limit=60)
    assert parts == [["a"], ["b", "e"], ["c", "d"]]
    # Spread evenly over two parts one would hold 70: first-fit decreasing's two parts of 60 stand.
    assert vllm_pack.fill_parts({"a": 30, "b": 30, "c": 20, "d": 20, "e": 20}, limit=60) == [["a", "b"], ["c", "d", "e"]]
    with pytest.raises(SystemExit, match="chunk a is 70 bytes, over the part limit of 60"):
        vllm_pack.fill_parts({"a": 70}, limit=60)
    assert vllm_pack.install_path("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so") is None
    assert vllm_pack.install_path("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so") == "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"
    assert vllm_pack.install_path("vllm/vllm-rs") is None
    assert vllm_pack.install_path("vllm/third_party/fmha_sm100/cutlass/x.hpp") is None
    assert vllm_pack.install_path("vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so") is None
    assert vllm_pack.install_path("vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so") is not None
    assert vllm_pack.install_path("x-1.0.data/platlib/x/_x.so") == "x/_x.so"
    assert vllm_pack.install_path("x-1.0.data/scripts/x") is None


def fake_part_set(tmp_path: Path) -> Path:
    """A fake set of three parts as vllm_pack writes them: tar.xz chunks of a few small files."""
    site, chunks, out = tmp_path / "fake_site", tmp_path / "chunks", tmp_path / "packed_vllm"
    chunks.mkdir()
    contents = {"vllm.tar.xz": {"vllm/__init__.py": b"version = 'fake'\n", "vllm/_C.abi3.so": os.urandom(3000)},
                "numpy.tar.xz": {"numpy/__init__.py": b"# fake\n"},
                "transformers.tar.xz": {"transformers/__init__.py": b"# fake\n"}}
    unpacked = {}
    for chunk, files in contents.items():
        for name, data in files.items():
            (site / name).parent.mkdir(parents=True, exist_ok=True)
            (site / name).write_bytes(data)
        unpacked[chunk] = vllm_pack.write_chunk(site, list(files), chunks / chunk)
    assert unpacked == {chunk: sum(map(len, files.values())) for chunk, files in contents.items()}
    sizes = {chunk: (chunks / chunk).stat().st_size for chunk in contents}
    parts = [["vllm.tar.xz"], ["numpy.tar.xz"], ["transformers.tar.xz"]]
    manifests = vllm_pack.write_manifests(out, parts, chunks, unpacked, {"vllm": "fake"})
    assert [m["part"] for m in manifests] == ["part1", "part2", "part3"]
    assert [m["files"][0]["bytes"] for m in manifests] == [sizes[p[0]] for p in parts]
    assert [m["files"][0]["unpacked_bytes"] for m in manifests] == [3017, 7, 7]
    assert len({m["set"] for m in manifests}) == 1
    return out


def crafted_part(folder: Path, member: tarfile.TarInfo, data: bytes = b"", declared: int | None = None) -> Path:
    """A part of one archive holding one crafted member, its manifest as vllm_pack writes it."""
    chunks = folder / "chunks"
    chunks.mkdir(parents=True)
    with lzma.open(chunks / "evil.tar.xz", "wb") as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        tar.addfile(member, io.BytesIO(data) if data else None)
    declared = len(data) if declared is None else declared
    vllm_pack.write_manifests(folder / "packed", [["evil.tar.xz"]], chunks, {"evil.tar.xz": declared}, {})
    return folder / "packed" / "part1"


def test_a_part_whose_archive_would_write_outside_the_site_or_past_its_declared_size_is_refused_by_member(
        tmp_path, capsys):
    outside = file_member("../escaped", b"x")
    absolute = file_member(str(tmp_path / "absolute"), b"x")
    link = tarfile.TarInfo("vllm/link")
    link.type, link.linkname = tarfile.SYMTYPE, "../../../escaped"
    bomb = file_member("vllm/big.bin", b"y" * 4096)
    cases = [(outside, b"x", None, "member '../escaped' is an absolute path or climbs out with '..'"),
             (absolute, b"x", None, f"member {str(tmp_path / 'absolute')!r} is an absolute path"),
             (link, b"", None, "member 'vllm/link' is a link or special file"),
             (bomb, b"y" * 4096, 1000, "member 'vllm/big.bin' takes the unpacked size to 4096 bytes, over the 1000")]
    for n, (member, data, declared, expected) in enumerate(cases):
        part = crafted_part(tmp_path / f"case{n}", member, data, declared)
        received = tmp_path / f"case{n}" / "deep" / "received"
        with pytest.raises(SystemExit) as refused:
            vllm_receive.receive(part, received)
        assert str(refused.value).startswith(f"part1/evil.tar.xz: {expected}"), str(refused.value)
        assert "nothing of the part unpacked" in str(refused.value)
        # Nothing written: no file in the site, the scratch folder gone, nothing beside or above it.
        assert [p for p in received.rglob("*") if not p.is_dir()] == [] and not (received / "unpacking").exists()
        assert not any(tmp_path.rglob("escaped")) and not (tmp_path / "absolute").exists()

    # A manifest naming a file outside its part, or of an older pack.sh without unpacked sizes.
    part = crafted_part(tmp_path / "named", file_member("vllm/ok.py", b"ok"), b"ok")
    manifest = json.loads((part / "manifest.json").read_text())
    for name in ("../evil.tar.xz", "sub/evil.tar.xz", ".."):
        manifest["files"][0]["file"] = name
        (part / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(SystemExit, match=f"manifest.json: file {name!r} is not a plain file name"):
            vllm_receive.verify_part(part)
    manifest["files"][0]["file"] = "evil.tar.xz"
    del manifest["files"][0]["unpacked_bytes"]
    (part / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SystemExit, match="evil.tar.xz has no unpacked_bytes"):
        vllm_receive.receive(part, tmp_path / "named" / "received")
    # The same member within its declared size is received.
    manifest["files"][0]["unpacked_bytes"] = 2
    (part / "manifest.json").write_text(json.dumps(manifest))
    vllm_receive.receive(part, tmp_path / "named" / "received")
    assert (tmp_path / "named" / "received" / "site" / "vllm" / "ok.py").read_bytes() == b"ok"

    # Each command with the wrong number of paths: its usage line, exit 2 (not an IndexError).
    assert vllm_receive.main(["receive", str(part)]) == 2
    assert capsys.readouterr().err == "usage: python vllm_receive.py receive PART_DIR RECEIVED\n"
    assert vllm_receive.main(["status"]) == 2 and "status RECEIVED" in capsys.readouterr().err



MALFORMED = [
    (lambda m: m.update(files={"evil.tar.xz": 1}), "files", "a non-empty list of the part's archives"),
    (lambda m: m.update(part="part9"), "part", "one of its parts (part1)"),
    (lambda m: m.update(parts="part1"), "parts", "a non-empty list of the set's part names"),
    (lambda m: m.update(set=7), "set", "a non-empty string"),
    (lambda m: m["files"].__setitem__(0, "evil.tar.xz"), "files[0]", "an object (file, bytes, sha256, unpacked_bytes)"),
    (lambda m: m["files"][0].update(bytes="2"), "files[0].bytes", "an integer >= 0"),
    (lambda m: m["files"][0].update(unpacked_bytes=None), "files[0].unpacked_bytes", "an integer >= 0"),
    (lambda m: m["files"][0].update(sha256=["x"]), "files[0].sha256", "64 lowercase hex digits"),
]


@pytest.mark.parametrize("change, key, wanted", MALFORMED, ids=[key for _, key, _ in MALFORMED])
def test_a_manifest_of_the_wrong_shape_is_refused_by_key_not_with_a_traceback(tmp_path, change, key, wanted):
    """Before: `files` not a list, a part not among `parts` or a size as text ended in an
    AttributeError, ValueError or TypeError traceback (or, `part` outside `parts`, a received.json
    that named it and broke `status`)."""
    part = crafted_part(tmp_path, file_member("vllm/ok.py", b"ok"), b"ok")
    manifest = json.loads((part / "manifest.json").read_text())
    change(manifest)
    (part / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SystemExit) as refused:
        vllm_receive.receive(part, tmp_path / "received")
    assert str(refused.value).startswith(f"{part / 'manifest.json'}: {key} must be {wanted}, not "), str(refused.value)
    assert not (tmp_path / "received" / "site").exists()


def test_a_part_of_more_members_than_a_part_may_hold_is_refused_empty_files_counted(tmp_path, monkeypatch):
    """Empty files cost no declared bytes but an inode each: before, a part of millions of them
    passed the size check. MAX_MEMBERS is lowered to 5 here; the part's archives count together."""
    monkeypatch.setattr(vllm_receive, "MAX_MEMBERS", 5)
    chunks = tmp_path / "chunks"
    chunks.mkdir()
    for chunk, count in (("a.tar.xz", 3), ("b.tar.xz", 3)):
        with lzma.open(chunks / chunk, "wb") as xz, tarfile.open(fileobj=xz, mode="w") as tar:
            for n in range(count):
                tar.addfile(file_member(f"{chunk[0]}/empty{n}", b""))
    vllm_pack.write_manifests(tmp_path / "packed", [["a.tar.xz", "b.tar.xz"]], chunks,
                              {"a.tar.xz": 0, "b.tar.xz": 0}, {})
    with pytest.raises(SystemExit) as refused:
        vllm_receive.receive(tmp_path / "packed" / "part1", tmp_path / "received")
    assert str(refused.value).startswith("part1/b.tar.xz: member 'b/empty2' takes the part past the 5 members it may "
                                         "hold, its archives together (empty files count too"), str(refused.value)
    assert [p for p in (tmp_path / "received").rglob("*") if not p.is_dir()] == []
    monkeypatch.setattr(vllm_receive, "MAX_MEMBERS", 6)  # exactly as many: received
    vllm_receive.receive(tmp_path / "packed" / "part1", tmp_path / "received")
    assert len(list((tmp_path / "received" / "site").rglob("empty*"))) == 6

def file_member(name: str, data: bytes) -> tarfile.TarInfo:
    member = tarfile.TarInfo(name)
    member.size = len(data)
    return member


def run_kit(*args, received: Path, python: str = "python3") -> subprocess.CompletedProcess:
    env = dict(os.environ, GPU_KIT_VLLM_RECEIVED=str(received), PYTHON=python)
    return subprocess.run(["bash", str(RUN), *map(str, args)], env=env, capture_output=True, text=True, timeout=60)


FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for the GPU machine's Python only for benchmarks/gpu_engine.py (which needs a GPU):
# prints what it was given and where vLLM would be imported from; anything else runs for real.
if [[ $1 == */benchmarks/gpu_engine.py ]]; then
    echo "engine args: ${*:2}"
    echo "PYTHONPATH=$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=$VLLM_USE_FLASHINFER_SAMPLER HF_HUB_OFFLINE=$HF_HUB_OFFLINE"
    exit 0
fi
exec python3 "$@"
"""


@pytest.mark.subprocess  # run.sh and vllm_receive.py (standard library only) in child processes
def test_a_fake_part_set_is_received_over_several_calls_and_a_missing_or_corrupted_part_refused(tmp_path):
    packed, received = fake_part_set(tmp_path), tmp_path / "received"

    first = run_kit("--receive", packed / "part1", received=received)
    assert first.returncode == 0, first.stderr
    assert "present part1; missing part2, part3" in first.stdout
    assert (received / "site" / "vllm" / "__init__.py").read_text() == "version = 'fake'\n"

    # A part that was not carried, a file missing from a part, a file changed: each refused by name.
    gone = run_kit("--receive", packed / "part4", received=received)
    assert gone.returncode == 1 and f"{packed / 'part4'}: no such folder" in gone.stderr
    (packed / "part2" / "numpy.tar.xz").rename(tmp_path / "numpy.tar.xz")
    missing = run_kit("--receive", packed / "part2", received=received)
    assert missing.returncode == 1 and "part2/numpy.tar.xz: missing" in missing.stderr
    (tmp_path / "numpy.tar.xz").rename(packed / "part2" / "numpy.tar.xz")
    data = bytearray((packed / "part3" / "transformers.tar.xz").read_bytes())
    data[-5] ^= 0xFF
    (packed / "part3" / "transformers.tar.xz").write_bytes(bytes(data))
    corrupt = run_kit("--receive", packed / "part3", received=received)
    assert corrupt.returncode == 1 and "part3/transformers.tar.xz: sha256 differs from the manifest" in corrupt.stderr
    assert not (received / "site" / "transformers").exists()  # nothing of a refused part is unpacked

    second = run_kit("--receive", packed / "part2", received=received)
    assert second.returncode == 0 and "present part1, part2; missing part3" in second.stdout

    fake_python = tmp_path / "python"
    fake_python.write_text(FAKE_PYTHON)
    fake_python.chmod(0o755)
    refused = run_kit("--engine", tmp_path / "results", received=received, python=str(fake_python))
    assert refused.returncode == 1 and "missing part3" in refused.stdout
    assert "receive the missing ones first" in refused.stderr and "engine args" not in refused.stdout

    data[-5] ^= 0xFF
    (packed / "part3" / "transformers.tar.xz").write_bytes(bytes(data))
    third = run_kit("--receive", packed / "part3", received=received)
    assert third.returncode == 0 and "present part1, part2, part3; missing none" in third.stdout
    engine = run_kit("--engine", tmp_path / "results", "--dry-run", received=received, python=str(fake_python))
    assert engine.returncode == 0, engine.stderr
    assert f"engine args: --out {tmp_path / 'results'} --deadline-s " in engine.stdout
    assert engine.stdout.rstrip().split("\n")[-2].endswith("--dry-run")
    assert f"PYTHONPATH={received / 'site'}" in engine.stdout
    assert "VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1" in engine.stdout
    state = json.loads((received / "received.json").read_text())
    assert state["received"] == ["part1", "part2", "part3"]


def test_the_import_scan_tells_an_unconditional_import_of_a_package_not_packed_from_a_guarded_one(tmp_path):
    vllm_imports = load("gpu_kit_vllm_imports", "vllm_imports.py")
    site = tmp_path / "site"
    (site / "vllm" / "engine").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(
        "import os\nfrom typing import TYPE_CHECKING\nfrom . import engine\nfrom .engine import core\n"
        "if TYPE_CHECKING:\n    import only_for_types\n"
        "try:\n    import guarded\nexcept ImportError:\n    guarded = None\n"
        "def later():\n    import in_a_function\n")
    (site / "vllm" / "engine" / "__init__.py").write_text("")
    (site / "vllm" / "engine" / "core.py").write_text(
        "import torch\nif torch.cuda.is_available():\n    import flashinfer\nclass Engine:\n    import tabulate\n")
    reached, missing = vllm_imports.scan(site, ("vllm",))
    assert set(reached) == {"vllm", "vllm.engine", "vllm.engine.core"}
    assert missing == {"flashinfer": ("vllm.engine.core", True), "tabulate": ("vllm.engine.core", False)}
    assert vllm_imports.main([str(site), "vllm"]) == 1  # tabulate is imported unconditionally
