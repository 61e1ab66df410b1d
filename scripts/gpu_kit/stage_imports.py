"""Which packages the GPU engine stage imports, read from the source (no import), against what the
GPU machine and the vLLM parts provide.

    python stage_imports.py              # the project's imports on the stage's path, against the lists
    python stage_imports.py --site SITE  # also each packed package's module-level imports, in SITE

Why: `run.sh --engine` runs benchmarks/gpu_engine.py (its checks, and `megatron-rl train` for
`learns`) with nothing on the path but the repository, the GPU machine's Python 3.12 and torch
(vllm_imports.TORCH_CLOSURE) and the received vLLM parts; a package missing there is an
ImportError minutes into a scarce GPU session. From STAGE_ENTRIES and every module of megatron_rl
(its registries import modules by name, which no reading of import statements follows: the
algorithms' lazy attributes, reward functions and agent environments named in a config) this
follows every import of the project's own modules (benchmarks/ and megatron_rl), inside functions
too (the checks import megatron_rl where they use it, megatron_rl imports heavy packages where it
uses them), but not behind `try: ... except ImportError` or `if TYPE_CHECKING`. Every third-party module reached must
be in torch's closure, come from a distribution pinned in the parts' requirement files
(IMPORT_NAMES says which), or be in NOT_ON_STAGE_PATH, with the reason the stage never imports it.
With --site (the received parts' site folder) the module-level imports of those packages are then
followed in SITE as vllm_imports.py follows vLLM's serve path. Exit 1 naming what is missing.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import vllm_imports  # noqa: E402  (a sibling script, not a package)

REPO = HERE.parents[1]
REQUIREMENTS = (HERE / "vllm_requirements.txt", HERE / "stage_requirements.txt")
# benchmarks/gpu_engine.py runs each check in a child that imports the three check modules; the
# learns check runs `python -m megatron_rl.cli train`.
STAGE_ENTRIES = ("gpu_engine", "gpu_engine_sync", "gpu_engine_fp8_r3", "gpu_engine_train", "megatron_rl.cli")
# The distribution each third-party import of the project comes from (a new import fails the check
# until it is named here, so that someone decides whether the parts need it).
IMPORT_NAMES = {
    "datasets": "datasets", "math_verify": "math-verify", "matplotlib": "matplotlib", "megatron": "megatron-core",
    "numpy": "numpy", "openai": "openai", "packaging": "packaging", "psutil": "psutil", "pyarrow": "pyarrow",
    "safetensors": "safetensors", "tokenizers": "tokenizers", "torch": "torch",
    "transformer_engine": "transformer-engine",
    "transformers": "transformers", "vllm": "vllm", "wandb": "wandb", "yaml": "pyyaml",
}
# Imported by the project only in functions that the engine stage does not call (read from the
# code): packing them would cost a part's room for nothing.
NOT_ON_STAGE_PATH = {
    "wandb": "observability/metrics_log.py, only for the trainer's metrics log when logging.wandb_mode is not "
             "disabled: the learns check disables it, no other check starts the trainer",
    "transformer_engine": "model/fp8.py, only after find_spec finds it (the engine stage trains without TE)",
}


def pinned_distributions(files=REQUIREMENTS) -> set[str]:
    """Canonical names of the distributions pinned in the parts' requirement files."""
    names = set()
    for path in files:
        for line in path.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                names.add(re.sub(r"[-_.]+", "-", line.split("==")[0].strip().lower()))
    return names


def project_modules(repo: Path = REPO) -> dict[str, Path]:
    """megatron_rl's modules by dotted name, and benchmarks/'s scripts by file name (the stage runs
    them with benchmarks/ on sys.path)."""
    modules = {}
    for path in (repo / "megatron_rl").rglob("*.py"):
        parts = list(path.relative_to(repo).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in (repo / "benchmarks").glob("*.py"):
        modules[path.stem] = path
    return modules


def every_import(path: Path, name: str) -> list[str]:
    """Every module `name` imports anywhere in its file (functions included), less those behind an
    ImportError guard or `if TYPE_CHECKING`."""
    tree = ast.parse(path.read_text())
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Try) and any(vllm_imports.catches_import_error(h) for h in node.handlers):
            for child in [*node.orelse, *node.finalbody, *(s for h in node.handlers for s in h.body)]:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.append(module)
            found.extend(f"{module}.{alias.name}" for alias in node.names)  # a submodule, or a name: tried both
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def scan_project(entries: tuple[str, ...] | None = None, repo: Path = REPO) -> dict[str, tuple[str, str]]:
    """{third-party module imported: (top-level name, first project module importing it)}; from
    `entries`, by default STAGE_ENTRIES and every module of megatron_rl."""
    modules = project_modules(repo)
    if entries is None:
        entries = STAGE_ENTRIES + tuple(sorted(name for name in modules if name.startswith("megatron_rl")))
    known = set(sys.stdlib_module_names) | {"__future__"}
    seen: set[str] = set()
    third_party: dict[str, tuple[str, str]] = {}
    stack = list(entries)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        for module in every_import(modules[name], name):
            pieces = module.split(".")
            own = [".".join(pieces[:n]) for n in range(len(pieces), 0, -1) if ".".join(pieces[:n]) in modules]
            if own:
                stack.extend(m for m in own if m not in seen)  # a package's __init__ runs with its module
            elif pieces[0] not in known and pieces[0] != "megatron_rl" and module not in third_party:
                third_party[module] = (pieces[0], name)
    return third_party


def check(third_party: dict[str, tuple[str, str]], pinned: set[str]) -> list[str]:
    """One line per top-level module the stage would not find."""
    problems, reported = [], set()
    for module, (top, importer) in sorted(third_party.items()):
        if top in reported or top in vllm_imports.TORCH_CLOSURE or top in NOT_ON_STAGE_PATH:
            continue
        distribution = IMPORT_NAMES.get(top)
        if distribution is None:
            problems.append(f"{top} (imported by {importer}): not in stage_imports.IMPORT_NAMES; name its "
                            "distribution there, and pin it in stage_requirements.txt if the stage imports it")
        elif distribution not in pinned:
            problems.append(f"{top} (imported by {importer}): {distribution} is pinned in neither "
                            f"{' nor '.join(p.name for p in REQUIREMENTS)}; add it to resolve_vllm.STAGE")
        else:
            continue
        reported.add(top)
    return problems


def main(argv: list[str]) -> int:
    third_party = scan_project()
    tops = sorted({top for top, _ in third_party.values()})
    print(f"the stage's project modules import {len(tops)} third-party packages: {' '.join(tops)}")
    problems = check(third_party, pinned_distributions())
    for top in sorted(set(tops) & set(NOT_ON_STAGE_PATH)):
        print(f"not packed, not on the stage's path: {top}: {NOT_ON_STAGE_PATH[top]}")
    if len(argv) == 2 and argv[0] == "--site":
        entries = tuple(m for m, (top, _) in third_party.items()
                        if top not in NOT_ON_STAGE_PATH and top not in vllm_imports.TORCH_CLOSURE)
        reached, missing = vllm_imports.scan(Path(argv[1]), entries)
        print(f"in {argv[1]}: {len(reached)} modules reached from them at module level")
        for name, (importer, conditional) in sorted(missing.items()):
            if conditional:
                print(f"not packed: {name} (imported by {importer}, behind a condition)")
            else:
                problems.append(f"{name} (imported by {importer} in the site, unconditionally)")
    for problem in problems:
        print(f"missing: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
