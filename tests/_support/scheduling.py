"""How the suite is spread over pytest-xdist workers (`MEGATRON_RL_TEST_WORKERS=2 bash scripts/test.sh`).

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
HEAVY_MARKS = ("engine", "multiprocess", "slurm")


def module_of(item) -> str:
    return item.nodeid.split("::", 1)[0]


def unit_of(item, server_modules: set[str]) -> str:
    module = module_of(item)
    if module in SANDBOX_MODULES:
        return "sandboxed-programs"
    if module in server_modules:
        return "shared-tiny-vllm-server"
    return module


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    server_modules = {module_of(item) for item in items if SHARED_SERVER_FIXTURE in getattr(item, "fixturenames", ())}
    units = [unit_of(item, server_modules) for item in items]
    heavy = {unit for unit, item in zip(units, items) if any(item.get_closest_marker(m) for m in HEAVY_MARKS)}
    for unit, item in zip(units, items):
        item.add_marker(pytest.mark.xdist_group(unit))
    # Stable: a module's tests keep their order and stay contiguous.
    order = sorted(range(len(items)), key=lambda index: units[index] not in heavy)
    items[:] = [items[index] for index in order]
