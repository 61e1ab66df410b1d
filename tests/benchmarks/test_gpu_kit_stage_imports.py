"""What the GPU engine stage imports against what reaches the GPU machine (scripts/gpu_kit/stage_imports.py):
the stage runs with only the machine's torch and the vLLM parts, which carry vllm_requirements.txt and
stage_requirements.txt; a package the project imports on the stage's path and neither list pins would
be an ImportError on the GPU. Read from the source, no network, no import of the packages."""

import importlib.util
import sys

from _support.processes import REPO

spec = importlib.util.spec_from_file_location("gpu_kit_stage_imports",
                                              REPO / "scripts" / "gpu_kit" / "stage_imports.py")
stage_imports = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = stage_imports
spec.loader.exec_module(stage_imports)


def test_every_package_the_engine_stage_imports_is_pinned_in_the_parts_or_on_the_gpu_machine():
    third_party = stage_imports.scan_project()
    tops = {top for top, _ in third_party.values()}
    # Not vacuous: the stage's model, its learning-curve PNG and its engine are found.
    assert {"megatron", "matplotlib", "vllm", "torch", "math_verify"} <= tops
    pinned = stage_imports.pinned_distributions()
    assert stage_imports.check(third_party, pinned) == []
    # Every exception still names something the stage's code imports (a stale one would hide nothing).
    assert set(stage_imports.NOT_ON_STAGE_PATH) <= tops
    # stage_requirements.txt is resolve_vllm.STAGE's resolution: each root pinned at STAGE's version.
    lines = (REPO / "scripts" / "gpu_kit" / "stage_requirements.txt").read_text().splitlines()
    pins = {line.split(" ", 1)[0] for line in lines if line and not line.startswith("#")}
    resolve_vllm = (REPO / "scripts" / "gpu_kit" / "resolve_vllm.py").read_text()
    for root in ("megatron-core==0.16.1", "matplotlib==3.11.2", "math-verify==0.9.0"):
        assert root in pins and f'"{root}"' in resolve_vllm

    # Without matplotlib pinned, the check names it and the module that imports it.
    problems = stage_imports.check(third_party, pinned - {"matplotlib"})
    assert len(problems) == 1 and problems[0].startswith("matplotlib (imported by megatron_rl.")


def test_the_scan_follows_imports_inside_functions_but_not_behind_an_import_error_guard(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "megatron_rl" / "train").mkdir(parents=True)
    (tmp_path / "benchmarks" / "entry.py").write_text(
        "import json\ndef run():\n    from megatron_rl.train import loop\n")
    (tmp_path / "megatron_rl" / "__init__.py").write_text("")
    (tmp_path / "megatron_rl" / "train" / "__init__.py").write_text("import numpy\n")
    (tmp_path / "megatron_rl" / "train" / "loop.py").write_text(
        "from typing import TYPE_CHECKING\nfrom . import plot\nif TYPE_CHECKING:\n    import only_types\n"
        "try:\n    import optional_thing\nexcept ImportError:\n    optional_thing = None\n"
        "class Loop:\n    def step(self):\n        for _ in range(2):\n            import megatron.core.models\n")
    (tmp_path / "megatron_rl" / "train" / "plot.py").write_text("def save():\n    import matplotlib.pyplot as plt\n")
    (tmp_path / "megatron_rl" / "unused.py").write_text("import wandb\n")  # never imported from the entry
    found = stage_imports.scan_project(("entry",), tmp_path)
    assert {module: top for module, (top, _) in found.items()} == {
        "numpy": "numpy", "megatron.core.models": "megatron", "matplotlib.pyplot": "matplotlib"}
    assert found["matplotlib.pyplot"][1] == "megatron_rl.train.plot"
    assert stage_imports.check(found, {"numpy", "megatron-core"}) == [
        "matplotlib (imported by megatron_rl.train.plot): matplotlib is pinned in neither vllm_requirements.txt "
        "nor stage_requirements.txt; add it to resolve_vllm.STAGE"]


def test_only_a_handler_that_catches_import_error_guards_an_import_in_both_scans(tmp_path):
    """`except RuntimeError` or a project's own `MyImportErrorLike` does not catch an ImportError:
    the import behind it fails on the GPU machine and both scans report it."""
    handlers = {"runtime": "RuntimeError", "lookalike": "MyImportErrorLike", "import_error": "ImportError",
                "tuple": "(ValueError, ImportError)", "attribute": "builtins.ModuleNotFoundError"}
    source = "".join(f"try:\n    import pkg_{name}\nexcept {handler}:\n    pass\n" for name, handler in handlers.items())
    source += "try:\n    import pkg_bare\nexcept:\n    import pkg_fallback\n"
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "megatron_rl").mkdir()
    (tmp_path / "benchmarks" / "entry.py").write_text(source)
    found = stage_imports.scan_project(("entry",), tmp_path)
    assert sorted(found) == ["pkg_fallback", "pkg_lookalike", "pkg_runtime"]

    site = tmp_path / "site" / "vllm"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text(source)
    _, missing = stage_imports.vllm_imports.scan(tmp_path / "site", ("vllm",))
    assert missing == {"pkg_runtime": ("vllm", False), "pkg_lookalike": ("vllm", False),
                       "pkg_fallback": ("vllm", True)}  # the fallback runs only when the guarded import fails
