"""Rollout engines that fail during a run stop it as a dead teacher does (train/trainer.py
Trainer._service_stop): one line naming every dead engine, its exit (code, signal) and its log,
the checkpoint of the last finished step written or named, run_state recorded, exit 1
(a TrainingStopped), every rank raising at the same point (rollout/client.py shares the driver's
error with the samples or the push).

- server engines behind the pool: one dies during step 1 (its prompts go to the other), the
  last one is SIGKILLed after step 1: step 2 stops with step 1's checkpoint;
- the weight push after a step trained reaches no engine: that step's checkpoint is kept;
- a colocated engine raising inside generate, and the asynchronous producer's pool running out
  of engines: the same RolloutFailed in one line.

The trainer is the real Trainer.run loop and the real RolloutClient, EnginePool and
VllmServerEngine against fake vLLM servers (one a process of its own, to be killed), in a one-rank
world; the model, the weight transport and the checkpoint files are stand-ins
(test_teacher_failures.py). A real run killed the same way is in docs/faults.md.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest

from _support.processes import free_port
from _support.world import world  # noqa: F401  (the one-rank world the client's broadcasts need)
from megatron_rl.errors import TrainingStopped
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.engines.server_process import ServerProcess
from megatron_rl.rollout.engines.vllm_server import VllmServerEngine
from megatron_rl.rollout.pool import EnginePool, RolloutFailed
from megatron_rl.rollout.protocol import EngineUnavailable, SamplingParams
from megatron_rl.train.async_collector import AsyncCollector
from megatron_rl.train.generation import Generation

TESTS = Path(__file__).parents[1]
sys.path[:0] = [str(Path(__file__).parent), str(TESTS / "rollout")]
from test_pool_mock_http import FakeVllm  # noqa: E402
from test_teacher_failures import OneProcess, trainer_with  # noqa: E402

PROMPTS = [[10 + i, 1, 2] for i in range(4)]
PARAMS = SamplingParams(n=2, max_tokens=3, seed=7)


def fake_server_process(tmp_path: Path) -> ServerProcess:
    """A fake vLLM server in a process of its own (what a run's `vllm serve` is to the pool)."""
    port = free_port()
    code = (f"import sys, time; sys.path[:0] = [{str(TESTS / 'rollout')!r}, {str(TESTS)!r}]; "
            f"import test_pool_mock_http as fake; fake.free_port = lambda: {port}; fake.FakeVllm(); time.sleep(600)")
    return ServerProcess.launch([sys.executable, "-c", code], env={"PATH": "/usr/bin:/bin"},
                                url=f"http://127.0.0.1:{port}", log_path=tmp_path / "logs" / "vllm-0.log",
                                name="vllm-0", startup_timeout_s=120)


def server_client(engines) -> RolloutClient:
    """The trainer's client of server engines, started (its transport a stand-in)."""
    config = SimpleNamespace(rollout=SimpleNamespace(mode="server", request_timeout_s=30))
    client = RolloutClient(config, model_dir=None, master_addr="127.0.0.1", local_rank=0, seed=0)
    client.engines, client._requests = engines, EnginePool(engines)
    client.transport = mock.Mock(destination="files", push=lambda stream: 0)
    return client


def rollout_trainer(tmp_path, client):
    trainer = trainer_with(None, tmp_path)
    trainer.config.rl.teacher = None
    trainer.rollout = client
    trainer.generation = Generation(client, lambda prompt: prompt, OneProcess())
    return trainer


def test_the_last_rollout_engine_killed_after_step_1_stops_the_run_with_step_1s_checkpoint(tmp_path, world):
    process = fake_server_process(tmp_path)
    other = FakeVllm()
    engines = [VllmServerEngine(process.url, name="vllm-0", process=process, max_retries=0),
               VllmServerEngine(other.url, name="vllm-1", max_retries=0)]
    trainer = rollout_trainer(tmp_path, server_client(engines))
    generated = []

    def rl_step(step):
        trainer.collector.cursor = step  # the step's prompts taken
        if step == 1:
            other.stop()  # one engine dies: its prompts move to vllm-0, the step goes on
        if step == 2:  # the last engine, killed between steps
            process.process.send_signal(signal.SIGKILL)
            process.process.wait(30)
        groups = trainer.generation.groups([SimpleNamespace(prompt=p) for p in PROMPTS], PARAMS)
        assert len(groups) == len(PROMPTS)
        generated.append(step)
        trainer.trained = step
        return {}

    trainer.rl_step = rl_step
    with pytest.raises(TrainingStopped) as caught:
        trainer.run()
    message = str(caught.value)
    assert isinstance(caught.value, TrainingStopped) and generated == [1]
    assert "\n" not in message and "Traceback" not in message, message
    log = tmp_path / "logs" / "vllm-0.log"
    assert message.startswith(
        f"step 2: the rollout engines could not generate: rollout-pool: no live engine left; dead: vllm-1: "), message
    assert "Connection refused" in message, message
    assert message.endswith(
        f"; vllm-0: server process exited with code -9 (killed by SIGKILL); its log: {log}. Nothing was trained on it; "
        f"checkpoint {tmp_path / 'checkpoints' / 'step_000001'} (step 1). Continue with the same command "
        f"(checkpoint.resume=auto)"), message
    # Step 1's save with the trainer state at its end (the cursor of step 1, not step 2's).
    assert trainer.checkpoints.saves[-1] == (1, trainer.checkpoints.saves[0][1], True)
    assert trainer.checkpoints.saves[-1][1]["sampler"] == {"cursor": 1}
    assert (tmp_path / "checkpoints" / "step_000001").is_dir() and trainer.checkpoints.run_state == (1, False)
    assert engines[0]._closed  # the trainer's shutdown stopped what was left of the pool


class Pausable:
    """A server engine's pause, resume and health (the fake servers have no /pause)."""

    name, dead = "vllm-0", False

    def health(self):
        if self.dead:
            raise EngineUnavailable(f"{self.name}: cannot reach http://127.0.0.1:9: [Errno 111] Connection refused")

    pause = resume = reset_prefix_cache = health

    def shutdown(self):
        pass


def test_a_push_that_reaches_no_engine_after_a_step_trained_keeps_that_step(tmp_path, world):
    engine = Pausable()
    client = server_client([engine])
    client._model_stream = lambda module, arch, merge_adapters: iter(())
    trainer = rollout_trainer(tmp_path, client)

    def rl_step(step):
        trainer.collector.cursor = step
        trainer.trained = step  # the step's updates are done; then its weights are pushed
        engine.dead = step == 2
        trainer.rollout.sync_weights(None, None)
        return {}

    trainer.rl_step = rl_step
    with pytest.raises(TrainingStopped, match=r"^step 2: the rollout engines could not take the weights: rollout-pool: "
                                              r"no live engine left; dead: vllm-0: cannot reach .* Connection refused\. Nothing .*"
                                              r"step_000002 \(step 2\)\. Continue with the same command") as caught:
        trainer.run()
    assert "\n" not in str(caught.value)
    assert trainer.checkpoints.saves[-1][0] == 2 and trainer.checkpoints.saves[-1][1]["sampler"] == {"cursor": 2}
    assert trainer.checkpoints.run_state == (2, False)


def test_a_colocated_engine_that_raises_and_an_async_producer_without_engines_stop_in_one_line(world):
    class Broken:
        name = "colocated-0"

        def generate(self, prompts, params, timeout_s=None):
            raise RuntimeError("EngineCore died\nworker traceback ...")

    config = SimpleNamespace(rollout=SimpleNamespace(mode="colocated", request_timeout_s=30))
    client = RolloutClient(config, model_dir=None, master_addr="127.0.0.1", local_rank=0, seed=0)
    client.engines, client._requests = [Broken()], Broken()
    with pytest.raises(RolloutFailed, match=r"^the rollout engine could not generate: RuntimeError: EngineCore died "
                                            r"\(at .*test_rollout_failures\.py:\d+\)$"):
        client.generate(PROMPTS, PARAMS)

    # The asynchronous producer's pool ran out of engines: the driver's error reaches every rank.
    collector = AsyncCollector.__new__(AsyncCollector)
    collector.runtime, collector.started = OneProcess(), True

    def take(step):
        try:
            raise EngineUnavailable("rollout-pool: no live engine left; dead: vllm-0: server process exited with "
                                    "code -9 (killed by SIGKILL); its log: vllm-0.log")
        except EngineUnavailable as exc:
            raise RuntimeError(f"asynchronous rollout failed: {exc}") from exc

    collector.producer = SimpleNamespace(take=take, before_push=take)
    with pytest.raises(RolloutFailed, match=r"^the rollout engines could not generate: rollout-pool: no live engine "
                                            r"left; dead: vllm-0: .*SIGKILL\); its log: vllm-0\.log$"):
        collector.take(2, {})
    with pytest.raises(RolloutFailed, match="no live engine left"):
        collector.before_push(1, {})
