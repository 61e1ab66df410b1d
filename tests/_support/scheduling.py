"""How the suite is spread over pytest-xdist workers (`bash scripts/test.sh` runs two).

Most of the suite's wall time is single-threaded: `megatron-rl train` runs and vLLM engines at
OMP_NUM_THREADS=1, servers starting up, SLURM scheduling. Run one after the other, the second
core idles for about half of it; two workers use it. What must stay together does:

- every test module is one unit of work (its module-scoped fixtures, a trained run or a set of
  engines, are made once), run on one worker;
- the modules that use the session's shared tiny vLLM server (tests/conftest.py) form one unit,
  so that one server serves them all instead of one per worker;
- the modules that run sandboxed programs form one unit: tests/sandbox/ asserts that no sandboxed
  process or work directory outlives a call, looking at the whole machine, so another module's
  sandboxes must not run beside it.

The units are handed out by `UnitScheduling` (pytest-xdist's scheduler hook), which finds a
test's unit from its node id alone: the scheduler runs in the controller, which sees node ids,
not fixtures. So the shared-server modules are listed here, and collection refuses a module that
uses the server without being listed. (pytest-xdist's own `--dist loadgroup` does not work with
this pytest: it renames node ids through an attribute pytest 9 no longer reads, so every test
became a unit of its own, module fixtures were made on both workers, and two workers were slower
than one.)

Units that start engines, rank groups or SLURM jobs are handed out first, so that a long one does
not start last and leave the other worker idle at the end. That order holds in a run without
workers too (each module's tests stay together and in their order); no test changes.
"""

from __future__ import annotations

import pytest

SANDBOX_MODULES = (
    "tests/sandbox/test_sandbox.py",
    "tests/rewards/test_code_task.py",
    "tests/rewards/test_rewards_code_tests.py",
    "tests/agents/test_python_tool.py",
    "tests/agents/test_agent_rollout_mock_engine.py",
    "tests/train/test_code_training.py",
)
SHARED_SERVER_FIXTURE = "tiny_vllm_server"
SHARED_SERVER_MODULES = (
    "tests/agents/test_agent_training.py",
    "tests/agents/test_agent_vllm.py",
    "tests/benchmarks/test_gpu_engine_dry_run.py",
    "tests/evaluation/test_command.py",
    "tests/rollout/test_partial_rollout.py",
    "tests/rollout/test_teacher_server.py",
    "tests/train/test_async_rl.py",
    "tests/train/test_lora_server.py",
)
HEAVY_MARKS = ("engine", "multiprocess", "slurm")


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def unit_of(nodeid: str) -> str:
    module = module_of(nodeid)
    if module in SANDBOX_MODULES:
        return "sandboxed-programs"
    if module in SHARED_SERVER_MODULES:
        return "shared-tiny-vllm-server"
    return module


def pytest_xdist_make_scheduler(config, log):
    """Work units as above, handed out in collection order (the heavy-first order below)."""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False  # keep our order, not xdist's largest-unit-first
    return UnitScheduling(config, log)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    unlisted = sorted({module_of(item.nodeid) for item in items
                       if SHARED_SERVER_FIXTURE in getattr(item, "fixturenames", ())} - set(SHARED_SERVER_MODULES))
    if unlisted:
        raise pytest.UsageError(f"{', '.join(unlisted)} use the {SHARED_SERVER_FIXTURE} fixture: add them to "
                                f"SHARED_SERVER_MODULES in tests/_support/scheduling.py, so that they share "
                                f"one worker and one server")
    units = [unit_of(item.nodeid) for item in items]
    heavy = {unit for unit, item in zip(units, items) if any(item.get_closest_marker(m) for m in HEAVY_MARKS)}
    # A unit's tests stay together, in their order, its modules one after the other (so a server
    # the unit shares is started once in a run without workers too); heavy units first.
    first = {}
    for index, unit in enumerate(units):
        first.setdefault(unit, index)
    order = sorted(range(len(items)), key=lambda index: (units[index] not in heavy, first[units[index]]))
    items[:] = [items[index] for index in order]
