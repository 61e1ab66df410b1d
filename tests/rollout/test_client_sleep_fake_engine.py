"""The rollout client's sleep mode sequence around training, with a fake engine: vLLM's sleep mode
runs on a GPU only (vLLM's CPU platform refuses enable_sleep_mode), so here a fake stands in for
the colocated engine behind the real client and the real in-process transport, and records the
order of its calls. The live engine's sleep and wake are checked on a GPU (benchmarks/gpu_engine.py).
"""

from __future__ import annotations

import pytest
import torch

from _support.world import world  # noqa: F401  (the one-rank world the client agrees over)
from megatron_rl.config import load_config
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.pool import RolloutFailed
from megatron_rl.rollout.protocol import EngineError, Sleeps, supports
from megatron_rl.rollout.weights.transport import InProcessTransport

WEIGHTS = [("model.embed_tokens.weight", torch.ones(4, 2)), ("lm_head.weight", torch.zeros(4, 2))]


class FakeSleepingEngine:
    """A fake colocated engine: what it was asked, in order, and what was asleep during the push."""

    name = "fake-colocated"

    def __init__(self, fail_on: str | None = None):
        self.calls: list[tuple] = []
        self.asleep: set[str] = set()
        self.fail_on = fail_on

    def _record(self, *call):
        if call[0] == self.fail_on:
            raise EngineError(f"{self.name}: {call[0]} failed")
        self.calls.append(call)

    def sleep(self, level):
        self._record("sleep", level)
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags=None):
        self._record("wake_up", tuple(tags))
        self.asleep -= set(tags)

    def update_weights(self, weights):
        names = [name for name, _ in weights]
        self._record("update_weights", len(names), tuple(sorted(self.asleep)))
        return len(names)

    def fingerprint(self):
        return None  # cannot tell: the transport's digest check skips it

    def generate(self, prompts, params, timeout_s=None): ...
    def pause(self): self._record("pause")
    def resume(self): self._record("resume")
    def reset_prefix_cache(self): self._record("reset_prefix_cache")
    def health(self): ...
    def shutdown(self): ...


def client_with(engine, overrides) -> RolloutClient:
    client = RolloutClient(load_config(None, overrides), model_dir=None, master_addr="127.0.0.1", local_rank=0, seed=0)
    client.engines, client._requests = [engine], engine
    client.transport = InProcessTransport()
    client.transport.connect([engine])
    client._model_stream = lambda module, arch, merge_adapters: iter(WEIGHTS)
    return client


def test_sleep_then_weights_woken_for_the_push_and_the_kv_cache_after_it_fake_engine(world):
    engine = FakeSleepingEngine()
    assert supports(engine, Sleeps)
    client = client_with(engine, ["rollout.sleep_level=2"])
    client.sleep()
    client.sleep()  # a second call while asleep asks nothing of the engine
    assert client.sync_weights(module=None, arch=None) == len(WEIGHTS)
    assert engine.calls == [
        ("sleep", 2),
        ("pause",),
        ("wake_up", ("weights",)),
        ("update_weights", 2, ("kv_cache",)),  # the push ran with the KV cache still released
        ("wake_up", ("kv_cache",)),
        ("reset_prefix_cache",),
        ("resume",),
    ]
    assert not client.asleep and not engine.asleep


def test_without_sleep_level_the_engine_is_never_put_to_sleep_fake_engine(world):
    engine = FakeSleepingEngine()
    client = client_with(engine, [])
    client.sleep()
    client.sync_weights(module=None, arch=None)
    assert [call[0] for call in engine.calls] == ["pause", "update_weights", "reset_prefix_cache", "resume"]


@pytest.mark.parametrize("failing", ["sleep", "wake_up"])
def test_a_failed_sleep_or_wake_stops_the_run_in_one_line_fake_engine(world, failing):
    client = client_with(FakeSleepingEngine(fail_on=failing), ["rollout.sleep_level=1"])
    with pytest.raises(RolloutFailed, match=f"could not {failing.replace('_', ' ')}: fake-colocated: {failing} failed"):
        client.sleep()
        client.sync_weights(module=None, arch=None)
