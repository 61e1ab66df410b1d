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
declares (an xz bomb) refuses the part by name, as does a part of more than MAX_MEMBERS members
(empty files cost no bytes but an inode each: a part of millions of them would fill the disk's
inodes). A manifest whose keys are missing or of the wrong kind (`files` not a list, a part not
among its `parts`) is refused naming the manifest and the key. Standard library only (and its
sibling kit.py): it runs under the GPU machine's bare Python.
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
# Members (files and folders) one part may unpack, all its archives together: 5 times the largest
# part pack.sh writes (the packed vLLM set: 21128 members in three parts, 9975 in the largest), so
# a real part fits and an archive of empty files cannot use up the disk's inodes.
MAX_MEMBERS = 50_000
AGAIN = "run scripts/gpu_kit/pack.sh again"


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
    if not isinstance(manifest, dict) or not {"set", "part", "parts", "files"} <= set(manifest):
        raise SystemExit(f"{path}: not a vLLM part's manifest (no set/part/parts/files); {AGAIN}")
    check_keys(manifest, path)
    return manifest


def check_keys(manifest: dict, path: Path) -> None:
    """Every key receiving reads, of the kind pack.sh writes: SystemExit naming `path` and the key."""
    def refuse(key: str, wanted: str, value) -> None:
        raise SystemExit(f"{path}: {key} must be {wanted}, not {json.dumps(value)[:60]}; refused ({AGAIN})")

    for key in ("set", "part"):
        if not isinstance(manifest[key], str) or not manifest[key]:
            refuse(key, "a non-empty string", manifest[key])
    parts = manifest["parts"]
    if not isinstance(parts, list) or not parts or not all(isinstance(name, str) and name for name in parts):
        refuse("parts", "a non-empty list of the set's part names", parts)
    if manifest["part"] not in parts:
        refuse("part", f"one of its parts ({', '.join(parts)})", manifest["part"])
    if not isinstance(manifest["files"], list) or not manifest["files"]:
        refuse("files", "a non-empty list of the part's archives", manifest["files"])
    for index, entry in enumerate(manifest["files"]):
        if not isinstance(entry, dict):
            refuse(f"files[{index}]", "an object (file, bytes, sha256, unpacked_bytes)", entry)
        name = entry.get("file")
        # A path of the manifest's own would name files outside the part (part / "../..").
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
            raise SystemExit(f"{path}: file {name!r} is not a plain file name in the part's folder; refused ({AGAIN})")
        if "unpacked_bytes" not in entry:
            raise SystemExit(f"{path}: {name} has no unpacked_bytes (a manifest of an older pack.sh); {AGAIN}")
        for key in ("bytes", "unpacked_bytes"):
            value = entry.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                refuse(f"files[{index}].{key}", "an integer >= 0", value)
        digest = entry.get("sha256")
        if not isinstance(digest, str) or len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
            refuse(f"files[{index}].sha256", "64 lowercase hex digits", digest)


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
    """What received.json says has arrived; {} (start afresh) when it is missing or not as written."""
    try:
        state = json.loads((received / "received.json").read_text())
    except (OSError, ValueError):
        return {}
    if not (isinstance(state, dict) and isinstance(state.get("set"), str) and isinstance(state.get("parts"), list)
            and isinstance(state.get("received"), list) and set(state["received"]) <= set(state["parts"])):
        return {}
    return state


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
        members = 0
        for entry in manifest["files"]:
            members += unpack_archive(part / entry["file"], scratch, entry["unpacked_bytes"],
                                      f"{manifest['part']}/{entry['file']}", MAX_MEMBERS - members)
        move_into(scratch, site)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if manifest["part"] not in state["received"]:
        state["received"] = sorted(state["received"] + [manifest["part"]], key=state["parts"].index)
    (received / "received.json").write_text(json.dumps(state, indent=1) + "\n")
    return state


def unpack_archive(archive: Path, into: Path, declared: int, where: str, members_left: int = MAX_MEMBERS) -> int:
    """Unpack one tar.xz into `into`, member by member (one pass over the stream), refusing a
    member that is not a plain file or folder, leaves `into`, passes the declared size, or is
    one more than `members_left`. Returns the members unpacked."""
    total = count = 0
    with tarfile.open(archive, "r|xz") as tar:
        for member in tar:
            name = PurePosixPath(member.name)
            count += 1
            if count > members_left:
                problem = (f"takes the part past the {MAX_MEMBERS} members it may hold, its archives together "
                           "(empty files count too: each is an inode)")
            elif not (member.isfile() or member.isdir()):
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
    return count


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
