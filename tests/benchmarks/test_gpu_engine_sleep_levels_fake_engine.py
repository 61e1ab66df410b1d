"""The GPU engine stage's colocated check (benchmarks/gpu_engine_sync.py check_colocated) down its
GPU path, with a fake engine: vLLM's sleep mode runs on a GPU only, so here a fake colocated engine
stands behind the real rollout client and in-process transport, and the stage's Step (policy,
training, logprobs) is a mock reporting free GPU memory by whether the engine is asleep. What the
GPU run holds (every sleep level slept through the client, woken by the push, and checked) is
checked here; the figures themselves are the GPU's."""

from __future__ import annotations

import importlib.util
import sys

import torch

from _support.processes import REPO
from _support.world import world  # noqa: F401  (the one-rank world the client agrees over)
from megatron_rl.config import load_config
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.weights.transport import InProcessTransport

WEIGHTS = [("model.embed_tokens.weight", torch.ones(4, 2))]


def load_stage():
    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("gpu_engine_sync", REPO / "benchmarks" / "gpu_engine_sync.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeColocatedEngine:
    """A fake colocated engine with sleep mode: the calls it was asked, in order."""

    name = "fake-colocated"

    def __init__(self):
        self.calls: list[tuple] = []
        self.asleep: set[str] = set()

    def sleep(self, level):
        self.calls.append(("sleep", level))
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))
        self.asleep -= set(tags)

    def update_weights(self, weights):
        self.calls.append(("update_weights", tuple(sorted(self.asleep))))
        return len(list(weights))

    def fingerprint(self):
        return None

    def pause(self): ...
    def resume(self): ...
    def reset_prefix_cache(self): ...
    def shutdown(self): ...


class MockStep:
    """gpu_engine_sync.Step, mocked: the real client over the fake engine; the engine's logprobs
    are the trainer's after a push and stale after training; free GPU memory is 10 GiB more while
    the engine sleeps."""

    def __init__(self, device, out, overrides, *, lr):
        self.device, self.engine = device, FakeColocatedEngine()
        self.config = load_config(None, overrides)
        self.client = RolloutClient(self.config, model_dir=None, master_addr="127.0.0.1", local_rank=0, seed=0)
        self.client.engines, self.client._requests = [self.engine], self.engine
        self.client.transport = InProcessTransport()
        self.client.transport.connect([self.engine])
        self.client._model_stream = lambda module, arch, merge_adapters: iter(WEIGHTS)
        self.pushes, self.stale = [], False

    def start_engine(self):
        return 0.0

    def push(self):
        self.pushes.append(self.client.sync_weights(module=None, arch=None))
        self.stale = False
        return {"tensors": self.pushes[-1]}

    def generate(self, seed):
        return [seed]

    def mismatch(self, samples):
        return {"max": 1.0, "mean": 1.0, "tokens": 1} if self.stale else {"max": 0.01, "mean": 0.001, "tokens": 1}

    def train(self, samples, steps):
        self.stale = True
        return {"GPU free GiB": 60.0 if self.engine.asleep else 50.0}

    def close(self):
        pass


def test_colocated_check_sleeps_at_each_level_and_checks_each_wake_mock_step(world, monkeypatch, tmp_path):
    stage = load_stage()
    steps = []
    monkeypatch.setattr(stage, "Step", lambda *args, **kwargs: steps.append(MockStep(*args, **kwargs)) or steps[-1])
    monkeypatch.setattr(stage, "gpu_memory", lambda device: {})  # no GPU here
    result = stage.check_colocated("cuda", {"out_dir": str(tmp_path)})
    (step,) = steps
    assert step.config.rollout.sleep_level == 1  # the engine starts with sleep mode
    woken = [("wake_up", ("weights",)), ("update_weights", ("kv_cache",)), ("wake_up", ("kv_cache",))]
    assert step.engine.calls == [("update_weights", ()), ("update_weights", ()),
                                 ("sleep", 1), *woken, ("sleep", 2), *woken]
    checks = {c["check"]: c["ok"] for c in result["checks"]}
    assert all(checks.values()), checks
    for level, push in ((1, 3), (2, 4)):
        assert checks[f"sleep level {level} frees GPU memory during training (GiB, must be > 0)"]
        assert f"push {push} (wakes the engine from level {level}): max abs(engine - trainer) logprob" in checks
        assert result["figures"][f"GPU memory freed during training by sleep level {level} GiB"] == 10.0
    assert result["figures"]["sleep levels"] == [1, 2] and "gpu_only" not in result
