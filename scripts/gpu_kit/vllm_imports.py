"""Which packages vLLM's serve path imports at module level, read from the source (no import).

    python vllm_imports.py SITE [MODULE,MODULE,...]   # SITE: the unpacked vLLM parts (received/site)

Why: the vLLM parts leave out packages that vLLM's metadata requires (resolve_vllm.DROPPED); this
shows, without a GPU, that none of them is imported unconditionally on the way to serving a
model. From the entry modules (default SERVE_PATH) it follows every import executed when a module
is imported: module and class bodies, both branches of an `if` (recorded as conditional), not
function bodies, not `if TYPE_CHECKING`, and not a `try` whose handler catches ImportError
(IMPORT_GUARDS, or a bare except; an `except RuntimeError` guards nothing), whose handlers' own
imports are recorded as conditional. It prints the packages reached, then each imported module found neither in SITE,
nor in the standard library, nor in torch's own closure (which the GPU machine has), with the
first module importing it and whether only behind a condition. Exit 1 if one is unconditional.
Static: imports by name at run time (registries, importlib) are not followed.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SERVE_PATH = ("vllm", "vllm.entrypoints.llm", "vllm.entrypoints.openai.api_server", "vllm.v1.engine.core",
              "vllm.v1.engine.async_llm", "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner",
              "vllm.model_executor.models.qwen3_moe", "vllm.v1.attention.backends.flash_attn",
              "vllm.model_executor.layers.fused_moe", "vllm.v1.sample.sampler", "vllm.v1.structured_output")
# torch 2.11.0's own closure, present on the GPU machine.
TORCH_CLOSURE = {"torch", "torchgen", "functorch", "triton", "sympy", "mpmath", "networkx", "jinja2", "markupsafe",
                 "filelock", "fsspec", "typing_extensions", "setuptools", "pkg_resources", "_distutils_hack",
                 "cuda", "nvidia"}
# The exception names whose handler catches an ImportError: matched exactly, so that neither
# `except RuntimeError` nor a project's `MyImportErrorLike` counts as a guard.
IMPORT_GUARDS = frozenset({"ImportError", "ModuleNotFoundError", "Exception", "BaseException"})


def catches_import_error(handler: ast.ExceptHandler) -> bool:
    """Whether `handler` catches an ImportError: a bare except, or one of IMPORT_GUARDS named by
    itself, as an attribute (builtins.ImportError) or in a tuple."""
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    names = [t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else None for t in types]
    return any(name in IMPORT_GUARDS for name in names)


def module_files(site: Path) -> dict[str, Path]:
    modules = {}
    for path in site.rglob("*.py"):
        parts = list(path.relative_to(site).with_suffix("").parts)
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if parts and all(part.isidentifier() for part in parts):
            modules[".".join(parts)] = path
    for path in site.rglob("*.so"):
        relative = path.relative_to(site)
        modules.setdefault(".".join([*relative.parts[:-1], relative.name.split(".")[0]]), path)
    for name in list(modules):  # namespace packages: a folder without __init__.py (megatron/ of megatron-core)
        pieces = name.split(".")
        for depth in range(1, len(pieces)):
            modules.setdefault(".".join(pieces[:depth]), site.joinpath(*pieces[:depth]))
    return modules


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> list[tuple[str, bool]]:
    """(module, conditional) for each import executed when `name` is imported."""
    try:
        tree = ast.parse(path.read_text(errors="replace"))
    except SyntaxError:
        return []
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: list[tuple[str, bool]] = []

    def visit(body: list, conditional: bool) -> None:
        for node in body:
            if isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body, True)
                visit(node.orelse, True)
            elif isinstance(node, ast.Try):
                if not any(catches_import_error(h) for h in node.handlers):
                    visit(node.body, conditional)
                for handler in node.handlers:  # a fallback import runs only when the body fails
                    visit(handler.body, True)
                visit(node.orelse, conditional)
                visit(node.finalbody, conditional)
            elif isinstance(node, (ast.With, ast.ClassDef)):
                visit(node.body, conditional)
            elif isinstance(node, ast.Import):
                found.extend((alias.name, conditional) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                found.append((module, conditional))
                found.extend((f"{module}.{a.name}", conditional) for a in node.names if f"{module}.{a.name}" in modules)

    visit(tree.body, False)
    return found


def scan(site: Path, entries: tuple[str, ...]) -> tuple[dict[str, bool], dict[str, tuple[str, bool]]]:
    """(modules of SITE reached, {missing module: (first importer, only conditionally)})."""
    modules = module_files(site)
    known = set(sys.stdlib_module_names) | TORCH_CLOSURE | {"__future__"}
    reached: dict[str, bool] = {}  # module: reached only behind a condition so far
    missing: dict[str, tuple[str, bool]] = {}
    stack = [(entry, "(entry)", False) for entry in entries]
    while stack:
        name, importer, conditional = stack.pop()
        pieces = name.split(".")
        for depth in range(1, len(pieces) + 1):
            prefix = ".".join(pieces[:depth])
            if prefix in modules:
                if reached.get(prefix, True) and not (prefix in reached and conditional):
                    reached[prefix] = conditional  # again when first reached only conditionally
                    if modules[prefix].suffix == ".py":
                        stack.extend((m, prefix, conditional or c) for m, c in imports_of(modules[prefix], prefix, modules))
            elif depth == 1 and pieces[0] not in known:
                if prefix not in missing or (missing[prefix][1] and not conditional):
                    missing[prefix] = (importer, conditional)
                break
            else:
                break  # a name imported from a module, or a module of the standard library or torch
    return reached, missing


def main(argv: list[str]) -> int:
    site = Path(argv[0])
    entries = tuple(argv[1].split(",")) if len(argv) > 1 else SERVE_PATH
    reached, missing = scan(site, entries)
    packages = sorted({name.split(".")[0] for name in reached})
    print(f"{len(reached)} modules of {len(packages)} packages reached: {' '.join(packages)}")
    for name, (importer, conditional) in sorted(missing.items()):
        print(f"not packed: {name} (imported by {importer}{', behind a condition' if conditional else ', UNCONDITIONALLY'})")
    return 1 if any(not conditional for _, conditional in missing.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
