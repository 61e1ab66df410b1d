"""Derive the pinned wheel lists of the GPU kit's vLLM parts from the registry: vLLM's
(vllm_requirements.txt) and the engine stage's own group (stage_requirements.txt).

    python resolve_vllm.py PYTHON3.12 OUT                          # vLLM's closure; needs network
    python resolve_vllm.py stage PYTHON3.12 VLLM_REQUIREMENTS OUT  # then STAGE, against vLLM's pins

PYTHON3.12: a Python 3.12 with pip, which resolves. Why a Python 3.12: pip evaluates
`python_version` markers for the interpreter it runs under, and --python-version changes only
which wheels fit; a 3.11 pip resolves vLLM's closure for 3.11.
The GPU machine brings torch 2.11.0+cu130 and its closure, so what torch itself pulls in is left
out. Then the packages vLLM needs only for what a text-only model on Hopper does not use (video,
image and audio codecs, FlashInfer's JIT, the CuTe DSL and the kernels built on it, the CUDA
compiler toolchain those pull in) are dropped (DROPPED, each with its reason), and with them what
only they require. vllm_imports.py shows that the serve path's modules import a dropped
package only behind a condition (an availability check).

The engine stage (benchmarks/gpu_engine.py) also imports the project, which needs what vLLM does
not bring (STAGE, each with its reason; stage_imports.py checks the list against the stage's
imports). The `stage` command resolves STAGE with vLLM's pins and torch's version as constraints,
so a dependency both share is packed once, at vLLM's version, and writes what is left beyond
vLLM's list and torch's closure. Standard library plus `packaging`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

VLLM = "vllm==0.26.0"
TORCH = "torch==2.11.0"
# The GPU machine's interpreter and platform. llguidance 1.7 (structured output) has no wheel older
# than manylinux_2_31, so the machine needs glibc >= 2.31; every other wheel fits manylinux_2_28.
TARGET = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
          "--abi", "cp312", "--abi", "abi3", "--abi", "none",
          *[arg for minor in range(5, 32) for arg in ("--platform", f"manylinux_2_{minor}_x86_64")],
          "--platform", "manylinux2014_x86_64", "--platform", "manylinux2010_x86_64",
          "--platform", "manylinux1_x86_64", "--platform", "any"]
DROPPED = {
    "opencv-python-headless": "image/video decoding (multimodal inputs)",
    "pynvvideocodec": "video decoding",
    "torchcodec": "video/audio decoding",
    "torchvision": "image processors of multimodal models",
    "torchaudio": "audio models",
    "numba": "n-gram speculative decoding and a few multimodal helpers, imported lazily",
    "llvmlite": "numba's compiler",
    "flashinfer-python": "FlashInfer (JIT-compiled kernels; VLLM_USE_FLASHINFER_SAMPLER=0 keeps the sampler off it)",
    "nvidia-cutlass-dsl": "CuTe DSL kernels (Blackwell paths)",
    "nvidia-cutlass-dsl-libs-base": "CuTe DSL",
    "nvidia-cutlass-dsl-libs-core": "CuTe DSL",
    "nvidia-cutlass-dsl-libs-cu12": "CuTe DSL",
    "nvidia-cutlass-dsl-libs-cu13": "CuTe DSL",
    "quack-kernels": "CuTe DSL kernels",
    "tokenspeed-mla": "MLA kernels (DeepSeek-style attention)",
    "tokenspeed-triton": "tokenspeed's own Triton (namespace tokenspeed_triton, not triton)",
    "tilelang": "TileLang kernels (JIT)",
    "z3-solver": "tilelang's solver",
    "torch-c-dlpack-ext": "tilelang/tvm-ffi DLPack extension",
    "cuda-tile": "cuTile kernels",
    "cuda-core": "cuda-python's object layer (cuTile, CuTe DSL)",
    "cuda-python": "meta package of cuda-bindings/cuda-core",
    "humming-kernels": "JIT kernels for quantized formats",
    "nvidia-cuda-nvcc": "the CUDA compiler humming-kernels pulls in",
    "nvidia-cuda-cccl": "CUDA C++ headers for the JIT paths",
    "nvidia-cuda-crt": "CUDA runtime headers for the JIT paths",
    "nvidia-nvvm": "NVVM for the JIT paths",
    "nvidia-cuda-nvdisasm": "disassembler for the JIT paths",
    "nvidia-cudnn-frontend": "cuDNN's Python frontend (FlashInfer's cuDNN paths)",
}
# What the engine stage needs beyond vLLM's closure and torch's (stage_imports.py finds them): the
# versions the project's CPU lock pins, so that the GPU runs the code the suite tests.
STAGE = {
    "megatron-core==0.16.1": "the policy's model (megatron.core): every check trains or computes logprobs",
    "matplotlib==3.11.2": "every `megatron-rl train` writes its learning-curve PNG (the learns check)",
    "math-verify==0.9.0": "the math reward's undecided answers, as on CPU (the learns check's reward)",
    "antlr4-python3-runtime==4.13.2": "math-verify's LaTeX parser runtime, at the CPU lock's version",
}
MARKERS = {"python_version": "3.12", "python_full_version": "3.12.0", "implementation_name": "cpython",
           "platform_machine": "x86_64", "sys_platform": "linux", "platform_system": "Linux",
           "os_name": "posix", "platform_python_implementation": "CPython"}


def report(python: str, requirement: str | list[str], scratch: Path, constraints: Path | None = None) -> dict:
    out = scratch / "report.json"
    requirements = [requirement] if isinstance(requirement, str) else requirement
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
                    "--report", str(out), "--target", str(scratch / "target"), *TARGET,
                    *(["-c", str(constraints)] if constraints else []), *requirements], check=True)
    return {canonicalize_name(item["metadata"]["name"]): item for item in json.loads(out.read_text())["install"]}


def requirements_of(item: dict, extras: tuple[str, ...]) -> set[tuple[str, tuple[str, ...]]]:
    found = set()
    for line in item["metadata"].get("requires_dist") or []:
        requirement = Requirement(line)
        marker = requirement.marker
        if marker is None or any(marker.evaluate(dict(MARKERS, extra=extra)) for extra in ("", *extras)):
            found.add((canonicalize_name(requirement.name), tuple(sorted(requirement.extras))))
    return found


def reachable(items: dict, start: str, blocked: set[str]) -> set[str]:
    """Distributions `start` requires, directly or not, without passing through `blocked`."""
    seen, names, stack = set(), set(), [(start, ())]
    while stack:
        node = stack.pop()
        if node in seen or node[0] in blocked or node[0] not in items:
            continue
        seen.add(node)
        names.add(node[0])
        stack.extend(requirements_of(items[node[0]], node[1]))
    return names


def pinned_line(item: dict) -> str:
    url = item["download_info"]["url"]
    digest = item["download_info"]["archive_info"]["hashes"]["sha256"]
    name, version = canonicalize_name(item["metadata"]["name"]), item["metadata"]["version"]
    return f"{name}=={version} --hash=sha256:{digest}  # {url.rsplit('/', 1)[-1]}"


def stage(python: str, vllm_requirements: str, out: str) -> int:
    """STAGE resolved with vLLM's pins and torch's version as constraints; written: what is left
    beyond vLLM's list and torch's closure (and never a dropped package)."""
    pins = [line.split(" ", 1)[0] for line in Path(vllm_requirements).read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    with tempfile.TemporaryDirectory() as scratch:
        constraints = Path(scratch) / "constraints.txt"
        constraints.write_text("\n".join([*pins, TORCH]) + "\n")
        items = report(python, list(STAGE), Path(scratch), constraints)
        torch = set(report(python, TORCH, Path(scratch)))
    packed = {canonicalize_name(pin.split("==")[0]) for pin in pins}
    roots = [canonicalize_name(Requirement(r).name) for r in STAGE]
    needed = set().union(*(reachable(items, root, set(DROPPED)) for root in roots)) - torch
    kept = sorted(needed - packed)
    lines = [f"# Written by resolve_vllm.py (python resolve_vllm.py stage python3.12 {Path(vllm_requirements).name}"
             f" {Path(out).name}); do not edit.",
             "# The engine stage's own group (resolve_vllm.STAGE, with why each is there), resolved for Python 3.12",
             f"# with {Path(vllm_requirements).name}'s pins and {TORCH} as constraints: {len(needed)} distributions"
             f" beyond torch's closure, {len(needed) - len(kept)} of them already in vLLM's list: {len(kept)} kept.",
             *(f"#   {requirement}: {why}" for requirement, why in STAGE.items()),
             "# Format: requirement --hash (what pip download checks), then the wheel's file name."]
    lines += [pinned_line(items[name]) for name in kept]
    Path(out).write_text("\n".join(lines) + "\n")
    print(f"{out}: {len(kept)} wheels")
    return 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "stage":
        return stage(*argv[1:])
    python, out = argv
    with tempfile.TemporaryDirectory() as scratch:
        items = report(python, VLLM, Path(scratch))
        torch = set(report(python, TORCH, Path(scratch)))
    missing = set(DROPPED) - set(items)
    if missing:
        raise SystemExit(f"DROPPED names {sorted(missing)}, which {VLLM}'s closure no longer has: update the list")
    beyond_torch = reachable(items, "vllm", set()) - torch
    kept = reachable(items, "vllm", set(DROPPED)) - torch
    only_through_dropped = sorted(beyond_torch - kept - set(DROPPED))
    lines = [f"# Written by resolve_vllm.py (python resolve_vllm.py python3.12 {Path(out).name}); do not edit.",
             f"# {VLLM}'s closure for Python 3.12 on manylinux x86_64: {len(items)} distributions; less {TORCH}'s",
             f"# own {len(torch)} (the GPU machine has them): {len(beyond_torch)}; less {len(DROPPED)} dropped"
             f" (resolve_vllm.DROPPED) and {len(only_through_dropped)} only they require"
             f" ({', '.join(only_through_dropped)}): {len(kept)} kept.",
             "# Format: requirement --hash (what pip download checks), then the wheel's file name."]
    lines += [pinned_line(items[name]) for name in sorted(kept)]
    Path(out).write_text("\n".join(lines) + "\n")
    print(f"{out}: {len(kept)} wheels")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
