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
(packed again since) starts the folder afresh. Standard library only: it runs under the GPU
machine's bare Python.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tarfile
from pathlib import Path

CHUNK = 1 << 24


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


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
    site = received / "site"
    site.mkdir(parents=True, exist_ok=True)
    for entry in manifest["files"]:
        with tarfile.open(part / entry["file"], "r:xz") as tar:
            tar.extractall(site, filter="data")  # no absolute paths, links out of site, devices
    if manifest["part"] not in state["received"]:
        state["received"] = sorted(state["received"] + [manifest["part"]], key=state["parts"].index)
    (received / "received.json").write_text(json.dumps(state, indent=1) + "\n")
    return state


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("receive", "status", "verify"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
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
