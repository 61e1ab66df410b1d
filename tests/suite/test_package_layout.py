"""The package's layout as docs/architecture.md draws it, checked from the imports (static, no
import is executed): every import points to the same floor or below, no two modules import each
other (directly or round a loop), only cli.py and errors.py stand loose at the top, and no module
is over 500 lines except those the architecture doc names as one piece."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rl"

# Top floor first; folders on one line may import each other.
FLOORS = [
    {"cli"},
    {"launch"},
    {"tools"},
    {"plan"},
    {"train", "evaluation"},
    {"agents"},
    {"rollout"},
    {"checkpoint"},
    {"bridge"},
    {"model"},
    {"runtime"},
    {"config"},
    {"data", "rewards"},
    {"sandbox"},
    {"algorithms"},
    {"observability"},
    {"errors"},
]
FLOOR = {room: height for height, rooms in enumerate(reversed(FLOORS)) for room in rooms}
LONG_ON_PURPOSE = {"algorithms/loss.py", "rollout/worker/inplace_copy.py", "sandbox/launcher.py"}  # docs/architecture.md says why


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """The megatron_rl modules `path` imports, anywhere in it (function-local imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("megatron_rl"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron_rl"):
            found.add(node.module)
            # `from megatron_rl.x import y` where y is a module
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                if (PACKAGE.parent / candidate.replace(".", "/")).with_suffix(".py").is_file():
                    found.add(candidate)
    return found


def room_of(module: str) -> str:
    return module.split(".")[1] if "." in module else "top"


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def test_every_import_points_down_or_across():
    upward = []
    for module, path in sorted(MODULES.items()):
        if module == "megatron_rl":
            continue
        source = room_of(module)
        for target in imports_of(path):
            if target == "megatron_rl" or room_of(target) == source:
                continue
            if FLOOR[room_of(target)] > FLOOR[source]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that run back up the floors of docs/architecture.md:\n" + "\n".join(upward)


def test_every_folder_has_a_floor():
    rooms = {room_of(module) for module in MODULES if module != "megatron_rl"}
    assert rooms <= set(FLOOR), f"folders without a floor in this test and the architecture doc: {rooms - set(FLOOR)}"


def test_no_import_circle():
    graph = {module: {t for t in imports_of(path) if t in MODULES and t != module} for module, path in MODULES.items()}
    # A package's __init__ importing its own modules is how a package presents them, not a circle.
    for module in graph:
        graph[module] = {t for t in graph[module] if not t.startswith(module + ".")}
    state, circles = {}, []

    def visit(module, stack):
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                circles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target, stack)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not circles, "modules that import each other:\n" + "\n".join(circles)


def test_only_cli_and_errors_at_the_top():
    loose = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "cli.py", "errors.py"], loose


def test_long_modules_are_the_named_ones():
    long = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if len(path.read_text().splitlines()) > 500}
    assert long <= LONG_ON_PURPOSE, f"over 500 lines without a line in docs/architecture.md: {long - LONG_ON_PURPOSE}"
