"""Receive the GPU kit's vLLM parts on the GPU machine, one part per command (docs/gpu_engine.md).

    python vllm_receive.py receive PART_DIR RECEIVED   # check PART_DIR against its manifest, unpack it
    python vllm_receive.py status RECEIVED             # exit 0 only when every part of the set is there
    python vllm_receive.py verify PART_DIR             # check only (pack.sh, tests)

A command on the GPU machine carries at most 64 MiB, so vllm_pack.py splits vLLM and its
dependencies into parts; each command carries one and unpacks it into RECEIVED (a git-ignored
folder of the working tree, which stays while the machine is warm): RECEIVED/site/ is the
site folder run.sh puts on PYTHONPATH, RECEIVED/received.json what has arrived. A part is
unpacked only when every one of its files has the size and sha256 its manifest names; a missing
or changed file is refused by name, and nothing of that part is unpacked. A part of another set
(packed again since) starts the folder afresh. The archives are unpacked into a scratch folder
first and moved into the site only when every member of the part passed: a manifest file name
other than a plain name, a member that is not a plain file or folder (a link), whose name is
absolute or climbs out with `..`, or that takes its archive past the unpacked size its manifest
declares (an xz bomb) refuses the part by name. Standard library only (and its sibling kit.py):
it runs under the GPU machine's bare Python.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
from pathlib import Path, PurePosixPath

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kit import sha256  # noqa: E402  (a sibling script, not a package)

USAGE = {"receive": "receive PART_DIR RECEIVED", "status": "status RECEIVED", "verify": "verify PART_DIR"}


def read_manifest(part: Path) -> dict:
    path = part / "manifest.json"
    if not part.is_dir():
        raise SystemExit(f"{part}: no such folder; carry it with this command (see docs/gpu_engine.md)")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"{path}: missing; {part} is not a vLLM part as scripts/gpu_kit/pack.sh writes it") from None
    except ValueError as error:
        raise SystemExit(f"{path}: not valid JSON ({error}); carry the part again") from None
    if not {"set", "part", "parts", "files"} <= set(manifest):
        raise SystemExit(f"{path}: not a vLLM part's manifest (no set/part/parts/files); run pack.sh again")
    for entry in manifest["files"]:
        name = entry.get("file")
        # A path of the manifest's own would name files outside the part (part / "../..").
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
            raise SystemExit(f"{path}: file {name!r} is not a plain file name in the part's folder; refused "
                             "(run scripts/gpu_kit/pack.sh again)")
        if not isinstance(entry.get("unpacked_bytes"), int):
            raise SystemExit(f"{path}: {name} has no unpacked_bytes (a manifest of an older pack.sh); "
                             "run scripts/gpu_kit/pack.sh again")
    return manifest


def verify_part(part: Path) -> list[str]:
    """What is missing from `part` or differs from its manifest (empty: as packed)."""
    manifest = read_manifest(part)
    problems = []
    for entry in manifest["files"]:
        path = part / entry["file"]
        if not path.is_file():
            problems.append(f"{manifest['part']}/{entry['file']}: missing")
        elif path.stat().st_size != entry["bytes"]:
            problems.append(f"{manifest['part']}/{entry['file']}: {path.stat().st_size} bytes, the manifest says {entry['bytes']}")
        elif sha256(path) != entry["sha256"]:
            problems.append(f"{manifest['part']}/{entry['file']}: sha256 differs from the manifest")
    return problems


def load_state(received: Path) -> dict:
    try:
        return json.loads((received / "received.json").read_text())
    except (OSError, ValueError):
        return {}


def missing_parts(state: dict) -> list[str]:
    return [name for name in state.get("parts", []) if name not in state.get("received", [])]


def describe(state: dict) -> str:
    if not state:
        return "no vLLM part received yet"
    present = ", ".join(state["received"]) or "none"
    missing = ", ".join(missing_parts(state)) or "none"
    return f"vLLM parts of set {state['set']}: present {present}; missing {missing}"


def receive(part: Path, received: Path) -> dict:
    """Check `part`, then unpack it into `received`/site; returns the new state."""
    manifest = read_manifest(part)
    problems = verify_part(part)
    if problems:
        raise SystemExit(f"{part}: refused, nothing unpacked: " + "; ".join(problems)
                         + " (carry the part again, or run scripts/gpu_kit/pack.sh again)")
    state = load_state(received)
    if state.get("set") != manifest["set"]:
        if state:
            print(f"{received}: held set {state.get('set')}; this part is of set {manifest['set']}: starting afresh")
        shutil.rmtree(received / "site", ignore_errors=True)
        state = {"set": manifest["set"], "parts": manifest["parts"], "received": []}
    site, scratch = received / "site", received / "unpacking"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        for entry in manifest["files"]:
            unpack_archive(part / entry["file"], scratch, entry["unpacked_bytes"], f"{manifest['part']}/{entry['file']}")
        move_into(scratch, site)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if manifest["part"] not in state["received"]:
        state["received"] = sorted(state["received"] + [manifest["part"]], key=state["parts"].index)
    (received / "received.json").write_text(json.dumps(state, indent=1) + "\n")
    return state


def unpack_archive(archive: Path, into: Path, declared: int, where: str) -> None:
    """Unpack one tar.xz into `into`, member by member (one pass over the stream), refusing a
    member that is not a plain file or folder, leaves `into`, or passes the declared size."""
    total = 0
    with tarfile.open(archive, "r|xz") as tar:
        for member in tar:
            name = PurePosixPath(member.name)
            if not (member.isfile() or member.isdir()):
                problem = "is a link or special file; the parts hold only files and folders"
            elif name.is_absolute() or ".." in name.parts:
                problem = "is an absolute path or climbs out with '..'"
            elif total + member.size > declared:
                problem = (f"takes the unpacked size to {total + member.size} bytes, over the {declared} "
                           "its manifest declares")
            else:
                total += member.size
                tar.extract(member, into, filter="data")  # the data filter too: no device, no setuid
                continue
            raise SystemExit(f"{where}: member {member.name!r} {problem}: refused, nothing of the part "
                             "unpacked (run scripts/gpu_kit/pack.sh again and carry the part again)")


def move_into(scratch: Path, site: Path) -> None:
    """Every file of `scratch` into the same place under `site` (a rename: the same disk)."""
    for path in sorted(scratch.rglob("*")):
        if path.is_file():
            target = site / path.relative_to(scratch)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in USAGE or len(argv) != len(USAGE[argv[0]].split()):
        wanted = USAGE.get(argv[0]) if argv else None
        print(f"usage: python vllm_receive.py {wanted}" if wanted else __doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    command, *paths = argv
    if command == "verify":
        problems = verify_part(Path(paths[0]))
        print("\n".join(problems) or f"{paths[0]}: every file as in its manifest")
        return 1 if problems else 0
    if command == "receive":
        state = receive(Path(paths[0]), Path(paths[1]))
        print(f"received {Path(paths[0]).name} into {paths[1]}/site; {describe(state)}")
        return 0
    state = load_state(Path(paths[0]))
    print(describe(state))
    return 0 if state and not missing_parts(state) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
