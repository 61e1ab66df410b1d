"""Faults around the conversion tools (tools/convert_*.py, `megatron-rl convert`): an output that
cannot be written is refused before any input file is read; a disk that fills up during the write
is named, with nothing left behind; a flipped bit in a converted checkpoint is caught by its
MANIFEST.json wherever the checkpoint is read.

Each conversion runs `convert.main` (what the tools scripts run) in a child forked from this test
process (`in_child`): the child starts in milliseconds with torch and Megatron-Core imported
already, where a new interpreter spends most of a tiny conversion importing them. A full disk is
a real one where the machine allows it: a small tmpfs mounted in a private mount namespace of the
child (as root, or as an unprivileged user namespace's root), invisible to the host and gone when
the child exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import multiprocessing
import os
import resource
import shutil
import signal
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_convert import llama  # noqa: E402,F401  (the tiny Llama: a fixture of the conversion tests)

from megatron_rl.checkpoint.format import load_initial_weights  # noqa: E402
from megatron_rl.checkpoint.output_guard import MARKER  # noqa: E402
from megatron_rl.errors import ConfigError  # noqa: E402
from megatron_rl.tools import convert  # noqa: E402

# What a conversion imports, imported once here: each forked child would import it again (seconds).
import megatron.core  # noqa: E402,F401  (first: the strategies module alone hits an import cycle)
import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa: E402,F401
import megatron.core.dist_checkpointing.strategies.torch  # noqa: E402,F401
import megatron_rl.bridge.hf_checkpoint  # noqa: E402,F401
import megatron_rl.model.builder  # noqa: E402,F401
import megatron_rl.runtime  # noqa: E402,F401

pytestmark = pytest.mark.subprocess  # runs a child process (pyproject's marks; scripts/test.sh --quick)

CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_RDONLY, MS_REC, MS_PRIVATE = 0x1, 0x4000, 0x40000
LEFT_FREE = 64 << 10  # what the filler leaves of the tmpfs: the first weight file does not fit


@dataclass
class Outcome:
    code: int | str  # convert.main's exit code, or the traceback it raised
    err: str
    listing: list[str]  # what is under `listing_root` afterwards (seen from inside the child)

    def error_line(self) -> str:
        """The one line `megatron-rl convert` prints for an error."""
        assert self.code == 2, f"exit {self.code}:\n{self.err[-3000:]}"
        assert "Traceback" not in self.err, self.err[-3000:]
        (line,) = [line for line in self.err.splitlines() if line.startswith("megatron-rl convert:")]
        return line


def in_child(argv: list[str], listing_root: Path, *, tmpfs: dict | None = None, before=None,
             main=convert.main) -> Outcome:
    """main(argv) (a conversion) in a forked child; `tmpfs`: mount one at tmpfs["at"] first (keys:
    size, read_only); `before()`: run in the child just before (patches that stay in the child)."""
    receive, send = multiprocessing.Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(target=_child,
                                                        args=(send, main, argv, listing_root, tmpfs, before))
    child.start()
    send.close()
    if not receive.poll(300):
        child.kill()
        pytest.fail(f"convert {argv[0]} did not finish in 300 s")
    outcome = receive.recv()
    child.join(30)
    return outcome


def _child(send, main, argv, listing_root: Path, tmpfs: dict | None, before) -> None:
    import torch

    from megatron_rl.checkpoint.store import start_write_results_queue

    torch.set_num_threads(1)  # the parent's thread pool does not survive the fork
    err = io.StringIO()
    try:
        if tmpfs is not None:
            mount_private_tmpfs(tmpfs["at"], tmpfs.get("size", "8m"), tmpfs.get("read_only", False))
            if not tmpfs.get("read_only"):
                (tmpfs["at"] / "keep.txt").write_text("precious")  # there before the conversion: must stay
        start_write_results_queue()  # forked now: spawned by the writer later it takes seconds
        if before is not None:
            before()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
    except BaseException:
        code = traceback.format_exc()
    listing = sorted(str(p.relative_to(listing_root)) for p in listing_root.rglob("*"))
    if tmpfs is not None and (tmpfs["at"] / "keep.txt").is_file():
        listing.append("keep.txt: " + (tmpfs["at"] / "keep.txt").read_text())
    send.send(Outcome(code, err.getvalue(), listing))


def mount_private_tmpfs(at: Path, size: str, read_only: bool) -> None:
    """This process into a mount namespace of its own (as root, else as root of a new user
    namespace), its mounts made private (nothing propagates to the host), then a tmpfs at `at`."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        uid, gid = os.getuid(), os.getgid()
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "unshare: no mount namespace for this process")
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
        Path("/proc/self/gid_map").write_text(f"0 {gid} 1")
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE, None)
    _mount(libc, "tmpfs", str(at), "tmpfs", MS_RDONLY if read_only else 0, f"size={size}")


def _mount(libc, source: str | None, target: str, kind: str | None, flags: int, data: str | None) -> None:
    encoded = [None if value is None else value.encode() for value in (source, target, kind, data)]
    if libc.mount(*encoded[:3], flags, encoded[3]) != 0:
        raise OSError(ctypes.get_errno(), f"mount {target}")


def _can_mount(directory: Path) -> bool:
    def probe():
        try:
            mount_private_tmpfs(directory, "1m", False)
        except OSError:
            os._exit(1)
        os._exit(0)

    child = multiprocessing.get_context("fork").Process(target=probe)
    child.start()
    child.join(60)
    return child.exitcode == 0


@pytest.fixture(scope="module")
def can_mount(tmp_path_factory) -> bool:
    return _can_mount(tmp_path_factory.mktemp("probe"))


@pytest.fixture(scope="module")
def converted(llama, tmp_path_factory) -> Path:
    """The tiny Llama converted to torch_dist (what `convert hf-to-megatron` writes)."""
    root = tmp_path_factory.mktemp("converted")
    outcome = in_child(["hf-to-megatron", "--hf-dir", str(llama), "--out", str(root / "mcore")], root)
    assert outcome.code == 0, outcome
    return root / "mcore"


@pytest.fixture(scope="module")
def converted_back(converted, tmp_path_factory) -> Path:
    """`converted` back to a Hugging Face directory (what `convert megatron-to-hf` writes)."""
    root = tmp_path_factory.mktemp("back")
    outcome = in_child(["megatron-to-hf", "--ckpt", str(converted), "--out", str(root / "hf")], root)
    assert outcome.code == 0, outcome
    return root / "hf"


def unreadable_copy(source: Path, target: Path) -> Path:
    """`source` with every file garbage: a conversion that reads any of them fails on it."""
    shutil.copytree(source, target)
    for file in target.rglob("*"):
        if file.is_file():
            file.write_bytes(b"\x00not what it was" + bytes(range(256)) * 4)
    return target


def argv_for(direction: str, source: Path, out: Path) -> list[str]:
    flag = "--hf-dir" if direction == "hf-to-megatron" else "--ckpt"
    return [direction, flag, str(source), "--out", str(out)]


def flip_one_bit(file: Path) -> None:
    """The lowest bit of the byte in the middle: the value it belongs to stays finite."""
    with open(file, "r+b") as handle:
        handle.seek(file.stat().st_size // 2)
        byte = handle.read(1)[0]
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte ^ 1]))


# ---- the output location: refused before any input file is read ---------------------------------


@pytest.mark.parametrize("direction", ["hf-to-megatron", "megatron-to-hf"])
def test_existing_output_is_refused_before_any_input_file_is_read(llama, converted, tmp_path, direction):
    """Every input file is garbage (config.json, megatron_rl.json, the weights): the refusal must
    come from the output check alone, so a long load never ends in "output exists"."""
    source = unreadable_copy(llama if direction == "hf-to-megatron" else converted, tmp_path / "input")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    line = in_child(argv_for(direction, source, out), tmp_path).error_line()
    assert f"output directory {out} already exists and it holds no {MARKER}" in line
    assert (out / "keep.txt").read_text() == "precious"


@pytest.mark.parametrize("where", ["read-only-directory", "file-in-the-way"])
def test_unwritable_output_is_refused_before_any_input_file_is_read(llama, tmp_path, can_mount, where):
    """A read-only directory: a read-only tmpfs where a mount namespace can be had (permissions
    do not stop root), else a directory without write permission (not root). A file in the way:
    the output's parent would have to be a directory where a file is."""
    source = unreadable_copy(llama, tmp_path / "input")
    tmpfs = None
    if where == "file-in-the-way":
        blocked = tmp_path / "notes.txt"
        blocked.write_text("a file")
        out, expected = blocked / "models" / "mcore", "is a file, not a directory"
    elif can_mount:
        (tmp_path / "ro").mkdir()
        tmpfs = {"at": tmp_path / "ro", "read_only": True}
        out, blocked, expected = tmp_path / "ro" / "mcore", tmp_path / "ro", "is on a read-only filesystem"
    elif os.geteuid() != 0:
        (tmp_path / "ro").mkdir(mode=0o555)
        out, blocked, expected = tmp_path / "ro" / "mcore", tmp_path / "ro", "is not writable by this user"
    else:
        # Root without a mount namespace: no directory is read-only to it. The other way a
        # parent cannot take the output instead (a skip is a failure in CI).
        blocked = tmp_path / "notes.txt"
        blocked.write_text("a file")
        out, expected = blocked / "models" / "mcore", "is a file, not a directory"
    try:
        line = in_child(["hf-to-megatron", "--hf-dir", str(source), "--out", str(out)], tmp_path,
                        tmpfs=tmpfs).error_line()
    finally:
        if (tmp_path / "ro").is_dir():
            (tmp_path / "ro").chmod(0o755)  # so that pytest can delete tmp_path
    assert f"cannot write {out}: {blocked} {expected}; pass an --out" in line


@pytest.mark.parametrize("direction", ["hf-to-megatron", "megatron-to-hf"])
def test_too_little_free_space_is_refused_before_loading_simulated(llama, converted, converted_back, tmp_path,
                                                                   direction):
    """shutil.disk_usage reports 1000 bytes free (simulated: patched in the child). The refusal
    names the output, the bytes needed (estimated from the input: within 15% of what the
    conversion really writes) and the bytes free; nothing is written."""
    source, real = (llama, converted) if direction == "hf-to-megatron" else (converted, converted_back)

    def little_space():
        usage = shutil.disk_usage(tmp_path)
        shutil.disk_usage = lambda path: usage._replace(free=1000)

    out = tmp_path / "out"
    line = in_child(argv_for(direction, source, out), tmp_path, before=little_space).error_line()
    assert f"not enough free space for {out}: the output needs about " in line
    assert f"the filesystem of {tmp_path} has 1000 bytes free; free up space there" in line
    needed = int(line.split("needs about ")[1].split(" bytes")[0])
    written = sum(f.stat().st_size for f in real.rglob("*") if f.is_file() and f.name != "MANIFEST.json")
    assert 0.85 * written <= needed <= 1.15 * written, (needed, written)
    assert not out.exists()


# ---- the disk fills up during the write ----------------------------------------------------------


def fill_before(module, writer: str, at: Path):
    """Patch `module.writer` so that the disk at `at` is filled (all but LEFT_FREE) when the
    conversion starts writing: after the free-space check, which it passed."""
    original = getattr(module, writer)

    def filled_first(*args, **kwargs):
        free = shutil.disk_usage(at).free
        with open(at / "filler", "wb") as handle:
            handle.write(b"\0" * (free - LEFT_FREE))
        return original(*args, **kwargs)

    setattr(module, writer, filled_first)


def limited_before(module, writer: str):
    """Patch `module.writer` to lower this process's file size limit (RLIMIT_FSIZE, inherited by
    the writer processes it starts) to LEFT_FREE first; SIGXFSZ ignored, so a write past it fails
    with EFBIG instead of killing the process."""
    original = getattr(module, writer)

    def limited_first(*args, **kwargs):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (LEFT_FREE, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        return original(*args, **kwargs)

    setattr(module, writer, limited_first)


WRITERS = {"hf-to-megatron": (convert, "save_megatron_checkpoint"),
           "megatron-to-hf": ("megatron_rl.bridge.streamed", "write_hf_from_torch_dist")}


def writer_of(direction: str):
    module, name = WRITERS[direction]
    if isinstance(module, str):
        import importlib

        module = importlib.import_module(module)
    return module, name


@pytest.mark.parametrize("direction", ["hf-to-megatron", "megatron-to-hf"])
def test_disk_full_on_a_small_tmpfs(llama, converted, tmp_path, can_mount, direction):
    """A real full disk: a 8 MiB tmpfs, filled up once the conversion starts writing. Writing
    torch_dist it surfaces as torch's "unexpected pos 704 vs 598" (a short write, no errno);
    writing safetensors as ENOSPC. The error names the output, "disk full" and the free bytes;
    the staging directory and the parent directories the run made are gone, a file that was on
    the disk before is untouched."""
    if not can_mount:
        # No mount namespace here (not root, no user namespaces): the file-size-limit stand-in
        # instead, so that the test still runs (a skip is a failure in CI).
        test_disk_full_stand_in_file_size_limit(llama, converted, tmp_path, direction)
        return
    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk / "models" / "llama" / "out"
    outcome = in_child(argv_for(direction, llama if direction == "hf-to-megatron" else converted, out), disk,
                       tmpfs={"at": disk, "size": "8m"}, before=lambda: fill_before(*writer_of(direction), disk))
    line = outcome.error_line()
    assert f"disk full while writing {out}: " in line
    assert f"were free on the filesystem of {disk} when the write failed" in line
    assert outcome.listing == ["filler", "keep.txt", "keep.txt: precious"], outcome.listing


@pytest.mark.parametrize("direction", ["hf-to-megatron", "megatron-to-hf"])
def test_disk_full_stand_in_file_size_limit(llama, converted, tmp_path, direction):
    """A stand-in for a full disk that needs no mount: RLIMIT_FSIZE, set in the child once the
    conversion starts writing, makes the write fail with EFBIG ("File too large") where a full
    disk fails with ENOSPC. It runs everywhere, also where test_disk_full_on_a_small_tmpfs
    cannot mount its tmpfs."""
    (tmp_path / "keep.txt").write_text("precious")
    out = tmp_path / "models" / "out"
    outcome = in_child(argv_for(direction, llama if direction == "hf-to-megatron" else converted, out), tmp_path,
                       before=lambda: limited_before(*writer_of(direction)))
    line = outcome.error_line()
    assert f"disk full while writing {out}: " in line and "file size limit is reached" in line
    assert f"were free on the filesystem of {tmp_path} when the write failed" in line
    assert outcome.listing == ["keep.txt"], outcome.listing
    assert (tmp_path / "keep.txt").read_text() == "precious"


# ---- a flipped bit in a converted checkpoint --------------------------------------------------


def test_bit_flip_in_converted_torch_dist_is_named(converted, tmp_path):
    """One bit of a weight file of `convert hf-to-megatron`'s output flipped: the value stays
    finite, so only the manifest can tell. `convert megatron-to-hf` refuses, naming the file and
    both checksums, and writes nothing; so does the loading behind `checkpoint.init_from`
    (format.load_initial_weights, which trainer and sft call; it verifies before it touches the
    model, so none is built here)."""
    ckpt = shutil.copytree(converted, tmp_path / "mcore")
    flip_one_bit(ckpt / "__0_0.distcp")
    problem = f"checkpoint {ckpt} is damaged: file {ckpt / '__0_0.distcp'} is corrupt (CRC-32 "
    line = in_child(argv_for("megatron-to-hf", ckpt, tmp_path / "hf"), tmp_path).error_line()
    assert problem in line and ", the manifest says " in line and "re-convert it" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mcore"]
    with pytest.raises(ConfigError, match="is corrupt") as refused:
        load_initial_weights(None, ckpt)
    assert problem in str(refused.value)


class _PolicyWhoseLoadFails:
    """A stand-in for a built Policy whose `load_model` raises what torch_dist's loader raises:
    torch gathers every rank's error into one CheckpointException, a BaseException."""

    def __init__(self, error: BaseException):
        import torch

        from megatron_rl.config import load_config

        self.error = error
        # init_from checks the model's adapters against the checkpoint's first: none on either side
        self.module, self.arch = torch.nn.Module(), None
        self.config = load_config(None, [])

    def load_model(self, directory: str) -> None:
        from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

        try:
            raise self.error
        except BaseException as raised:
            raise CheckpointException("load failed", {0: _wrap_exception(raised)}) from None


def test_a_gathered_load_error_is_one_line_stand_in_policy(converted):
    """`checkpoint.init_from` of an intact checkpoint the model cannot take: the load's error,
    gathered by torch into a CheckpointException (a BaseException), passed `except Exception` and
    ended the run in a traceback. Seen with a LoRA policy loading a checkpoint without adapters,
    which Policy.load_model now takes; the stand-in policy raises the exception torch raised then
    (building a real Policy here would start a Megatron runtime in the test process). A stop
    signal gathered the same way still unwinds as itself."""
    missing = KeyError("decoder.layers.0.self_attention.linear_proj.lora_A from model not in state dict")
    with pytest.raises(ConfigError) as refused:
        load_initial_weights(_PolicyWhoseLoadFails(missing), converted)
    line = str(refused.value)
    assert line.startswith(f"cannot load the weights in {converted}") and ": KeyError: " in line, line
    assert "lora_A from model not in state dict" in line, line  # the gathered error, not "ranks: [0]"
    assert "\n" not in line and "use another checkpoint" in line.lower(), line
    with pytest.raises(KeyboardInterrupt):
        load_initial_weights(_PolicyWhoseLoadFails(KeyboardInterrupt()), converted)


def test_bit_flip_in_converted_hf_directory_is_named(converted_back, tmp_path):
    """`convert megatron-to-hf`'s output carries the manifest too, and the extra file disturbs
    neither transformers nor verify-hf. One bit flipped in its safetensors: `convert
    hf-to-megatron`, verify-hf and init_from refuse it, naming the file."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.tools import verify_hf

    manifest = json.loads((converted_back / "MANIFEST.json").read_text())
    assert manifest["checksum"] == "crc32" and "model-00001-of-00001.safetensors" in manifest["files"]
    AutoModelForCausalLM.from_pretrained(converted_back)
    checked = in_child(["--hf-dir", str(converted_back)], tmp_path, main=verify_hf.main)
    assert checked.code == 0, checked.err[-3000:]
    hf = shutil.copytree(converted_back, tmp_path / "hf")
    flip_one_bit(hf / "model-00001-of-00001.safetensors")
    problem = f"checkpoint {hf} is damaged: file {hf / 'model-00001-of-00001.safetensors'} is corrupt (CRC-32 "
    line = in_child(argv_for("hf-to-megatron", hf, tmp_path / "mcore"), tmp_path).error_line()
    assert problem in line and "download or convert the model again" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    with pytest.raises(ConfigError, match="download or convert the model again") as refused:
        verify_hf.check_input(verify_hf.parser().parse_args(["--hf-dir", str(hf)]))
    assert problem in str(refused.value)
    with pytest.raises(ConfigError, match="is corrupt"):
        load_initial_weights(None, hf)
