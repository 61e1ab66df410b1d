"""A script of benchmarks/ loaded as a module, as the benchmarks run it (benchmarks/ on sys.path,
so its sibling imports resolve)."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from _support.processes import REPO


def load_benchmark(name: str) -> ModuleType:
    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
