"""A rollout server dying with samples in flight: a named error, its prompts go to the live engines,
no sample lost or counted twice; later requests and weight pushes skip it.

Live: two real vLLM CPU servers (a tiny Qwen3 with dummy weights) behind one EnginePool; one is
killed (SIGKILL, its whole process group) while its requests run. Checked: the warning names the
killed engine (EngineDied), every prompt comes back once with n samples, identical to what the
survivor generates alone for the same request (same per-prompt seeds), `pool.dead` names it, the
next generate goes to the survivor only, and a files weight push reaches the survivor after
`transport.drop`. Against fakes (cheap, deterministic): concurrent one-prompt calls spread over
the engines by load, a refused request is not a death, pause modes, and the collective transport
rebuilding its gloo groups among the survivors.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import torch

from _support.processes import forked_python, free_port
from _support.world import world  # noqa: F401  (the one-rank world the transports need)
from megatron_rl.rollout import EngineError, EnginePool, SamplingParams
from megatron_rl.rollout.protocol import EngineDied, EngineUnavailable
from megatron_rl.rollout.engines.vllm_server import VllmServerEngine
from megatron_rl.rollout.weights.digest import WeightDigest

sys.path.insert(0, str(Path(__file__).parents[1] / "bridge"))
from test_pool_mock_http import fakes  # noqa: E402,F401  (the fixture of fake servers)

pytestmark = pytest.mark.engine

POOL_LOGGER = "megatron_rl.rollout.pool"


# ---- live: a real server killed mid-request ----------------------------------------------------


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[rollout-cpu])")
    from test_bridge import make_hf_model
    from vocab_tokenizer import write_tokenizer

    from megatron_rl.model.hf_config import load_hf_config
    from megatron_rl.rollout.engines.vllm_server import VllmServerProcess

    root = tmp_path_factory.mktemp("failover")
    raw = dict(load_hf_config("tiny-qwen3")[0], vocab_size=256)
    make_hf_model(raw, root / "hf")
    write_tokenizer(root / "hf", raw["vocab_size"])

    def start(index):
        # vllm-0 is a fresh process tree (the reaping test looks at it); vllm-1, the one killed in
        # flight, is forked with its engine process from the pre-imported Python (zygote.py).
        return VllmServerProcess.start(
            root / "hf", port=free_port(), log_path=root / f"vllm-{index}.log", name=f"vllm-{index}",
            max_model_len=256, load_format="dummy", startup_timeout_s=300,
            extra_args=["--distributed-executor-backend", "uni"], python=forked_python() if index else None)

    with ThreadPoolExecutor(max_workers=2) as pool:
        started = [pool.submit(start, index) for index in range(2)]
        processes = [future.result() for future in started]
    yield root, processes
    for process in processes:
        process.stop()


def test_server_killed_in_flight_its_prompts_go_to_the_survivor(servers, world, tmp_path, caplog):
    from safetensors.torch import load_file

    from megatron_rl.rollout.weights.transport import FilesTransport

    root, processes = servers
    engines = [VllmServerEngine(process.url, name=process.name, process=process, max_retries=1)
               for process in processes]
    survivor, victim = engines
    calls = []
    for engine in engines:
        engine.generate = recorded(engine, calls)
    transport = FilesTransport(tmp_path / "staging", bucket_bytes=64 << 20)
    transport.connect(list(engines))
    pool = EnginePool(engines)

    # Kill the victim's whole server once its requests are running.
    sent, lock, counts, at_kill = threading.Event(), threading.Lock(), {"started": 0, "done": 0}, {}
    post = victim._client.post

    def counting_post(path, body=None, **kwargs):
        if path != "/v1/completions":
            return post(path, body, **kwargs)
        with lock:
            counts["started"] += 1
        sent.set()
        result = post(path, body, **kwargs)
        with lock:
            counts["done"] += 1
        return result

    def kill():
        # Killed as soon as its request is on the way (no clock: a fast machine could finish it
        # in any fixed wait), so it is in flight by construction.
        assert sent.wait(timeout=60), "the victim was never sent a request"
        with lock:
            at_kill.update(counts)
        os.killpg(victim.process.process.pid, signal.SIGKILL)

    victim._client.post = counting_post
    prompts = [[3 + index, 7, 11, 13] for index in range(16)]
    params = SamplingParams(n=2, max_tokens=48, seed=5)
    caplog.set_level(logging.WARNING, logger=POOL_LOGGER)
    killer = threading.Thread(target=kill)
    killer.start()
    groups = pool.generate(prompts, params, timeout_s=120)
    killer.join()

    assert at_kill["started"] > at_kill["done"], f"no victim request was in flight at the kill: {at_kill}"
    died = [r.getMessage() for r in caplog.records if r.name == POOL_LOGGER and r.levelno == logging.WARNING]
    assert len(died) == 1 and "vllm-1" in died[0] and "EngineDied" in died[0], died
    assert pool.dead == ["vllm-1"] and pool.live == [survivor]
    assert isinstance(pool.cause("vllm-1"), EngineDied)
    # Every prompt once, n samples each, in order (the pool's check_grouping), and exactly what the
    # survivor generates alone: the moved prompts kept their seeds, none was lost or doubled.
    assert [[(s.prompt_index, s.sample_index) for s in g] for g in groups] == [[(i, 0), (i, 1)] for i in range(16)]
    assert [g[0].prompt_token_ids for g in groups] == prompts
    alone = survivor.generate(prompts, params)  # recorded as the last call
    assert [[s.response_token_ids for s in g] for g in groups] == [[s.response_token_ids for s in g] for g in alone]
    # (engine, first global index, prompts): the two slices, then the victim's moved to the survivor.
    assert sorted(calls[:2]) == [("vllm-0", 0, 8), ("vllm-1", 8, 8)]
    assert calls[2:] == [("vllm-0", 8, 8), ("vllm-0", 0, 16)]

    # Later requests go to the survivor only.
    del calls[:]
    again = pool.generate(prompts[:4], params, timeout_s=120)
    assert [[s.response_token_ids for s in g] for g in again] == [[s.response_token_ids for s in g] for g in alone[:4]]
    assert calls == [("vllm-0", 0, 4)]
    pool.pause()
    pool.resume()
    pool.health()

    # A weight push: refused while the dead engine is addressed, delivered to the survivor once dropped.
    tensors = load_file(str(root / "hf" / "model.safetensors"))
    with pytest.raises(EngineError, match="vllm-1"):
        transport.push(iter(tensors.items()))
    transport.drop(pool.dead)
    assert [engine.name for engine in transport.engines] == ["vllm-0"]
    assert transport.push(iter(tensors.items())) == len(tensors)
    pool.reset_prefix_cache()


def http_status(url: str, method: str, body: dict | None = None, token: str | None = None) -> int:
    """A raw request, as anyone who can reach the port could send it."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, method=method, headers=headers),
                                    timeout=60) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_requests_without_the_jobs_token_are_refused_and_a_tampered_engine_stops_the_push(servers, world, tmp_path):
    """The audit's attack: POST /collective_rpc update_weights_from_files with a file of zeros
    returned 200 and the engine served zeros. Without the job's token every route but /health is
    refused (401); a client that has the token (a second job sharing it, a stray tool) and loads
    other weights is named at the trainer's next push, which stops instead of training on them."""
    from safetensors.torch import load_file, save_file

    from megatron_rl.rollout.protocol import WeightsNotServed
    from megatron_rl.rollout.weights.transport import FilesTransport

    root, processes = servers
    process = processes[0]
    tensors = load_file(str(root / "hf" / "model.safetensors"))
    zeros = tmp_path / "zeros"
    zeros.mkdir()
    save_file({name: torch.zeros_like(tensor) for name, tensor in tensors.items()}, str(zeros / "model.safetensors"))
    (zeros / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {name: "model.safetensors" for name in tensors}}))
    attack = {"method": "update_weights_from_files", "args": [json.dumps([str(zeros / "model.safetensors")])]}

    assert http_status(f"{process.url}/health", "GET") == 200  # liveness stays open
    for token in (None, "not-the-job-token"):
        assert http_status(f"{process.url}/collective_rpc", "POST", attack, token) == 401
        assert http_status(f"{process.url}/pause", "POST", {}, token) == 401
        assert http_status(f"{process.url}/v1/models", "GET", None, token) == 401
        assert http_status(f"{process.url}/metrics", "GET", None, token) == 401
        assert http_status(f"{process.url}/collective_rpc", "POST",
                           {"method": "join_weight_group", "args": ["{}", 0]}, token) == 401

    engine = VllmServerEngine(process.url, name=process.name, process=process, max_retries=1)
    transport = FilesTransport(tmp_path / "staging", bucket_bytes=64 << 20)
    transport.connect([engine])
    assert transport.push(iter(tensors.items())) == len(tensors)
    assert transport.push(iter(tensors.items())) == len(tensors)  # the refused requests changed nothing

    engine.load_weight_files(str(zeros))  # with the token, behind the trainer's back
    with pytest.raises(WeightsNotServed, match=r"vllm-0 last received .*sum of squares 0, but this trainer pushed"):
        transport.push(iter(tensors.items()))


def test_a_server_whose_main_process_died_is_reaped_with_its_whole_tree(servers):
    """Its engine-core process outlived it (on a GPU, holding the GPU's memory): stop() returned
    early when the main process was gone. Runs last on the live servers (it ends vllm-0)."""
    _, processes = servers
    process = processes[0]
    group = process.process.pid
    members = [p for p in psutil.process_iter() if _in_group(p, group)]
    assert len(members) >= 2, "the server should run its engine core in a child process"
    # `uni` on CPU: the one worker runs inside the engine core; before, vLLM's CPU platform
    # turned it into `mp` and spawned a VLLM::Worker (one more import of torch and vLLM, 11 s of
    # a 31 s start on 2 cores)
    names = [p.name() for p in members]
    assert "VLLM::EngineCore" in names and "VLLM::Worker" not in names, names
    os.kill(process.process.pid, signal.SIGKILL)  # the API server alone, as an OOM kill would
    process.process.wait()
    assert [p for p in psutil.process_iter() if _in_group(p, group)], "its children outlived it"
    process.stop(grace_s=30)
    assert not [p for p in psutil.process_iter() if _in_group(p, group)]


def _in_group(process, group: int) -> bool:
    try:
        return os.getpgid(process.pid) == group and process.status() != psutil.STATUS_ZOMBIE
    except (ProcessLookupError, psutil.Error):
        return False


def recorded(engine, calls):
    generate = engine.generate

    def wrapper(prompts, params, timeout_s=None):
        calls.append((engine.name, params.seed_offset, len(prompts)))
        return generate(prompts, params, timeout_s)

    return wrapper


# ---- fakes: routing, refused requests, pause modes ---------------------------------------------


def test_concurrent_one_prompt_calls_go_to_the_least_busy_engine(fakes):
    params = SamplingParams(n=2, max_tokens=3, seed=9)
    servers = [fakes(delay_s=0.5) for _ in range(3)]
    pool = EnginePool([VllmServerEngine(s.url, name=f"vllm-{i}", max_retries=0) for i, s in enumerate(servers)])
    prompts = [[20 + i, 1] for i in range(9)]
    with ThreadPoolExecutor(max_workers=9) as threads:
        futures = [threads.submit(pool.generate, [prompt], params.offset(index), 30)
                   for index, prompt in enumerate(prompts)]
        groups = [future.result()[0] for future in futures]
    assert [s.completions for s in servers] == [3, 3, 3]  # not all on vllm-0
    assert pool.in_flight() == {"vllm-0": 0, "vllm-1": 0, "vllm-2": 0}
    # Each group carries the seed of its global index: the same as one call with every prompt.
    whole = pool.generate(prompts, params)
    assert [[s.response_token_ids for s in g] for g in groups] == [[s.response_token_ids for s in g] for g in whole]
    assert [s.completions for s in servers] == [6, 6, 6]  # contiguous slices of three


def test_a_refused_request_is_not_a_death(fakes):
    healthy, refusing = fakes(), fakes(fail_with=400)
    pool = EnginePool([VllmServerEngine(healthy.url, name="vllm-0"), VllmServerEngine(refusing.url, name="vllm-1")])
    with pytest.raises(EngineError, match="vllm-1.*HTTP 400") as info:
        pool.generate([[5, 1], [6, 1]], SamplingParams(seed=1))
    assert not isinstance(info.value, EngineUnavailable)
    assert pool.dead == []


class PausingEngine:
    def __init__(self, name, takes_mode):
        self.name, self.calls = name, []
        if takes_mode:
            self.pause = lambda mode="wait": self.calls.append(("pause", mode))
        else:
            self.pause = lambda: self.calls.append(("pause",))

    def health(self):
        pass


def test_pause_modes_reach_the_engines_that_take_them():
    with_mode, without = PausingEngine("a", takes_mode=True), PausingEngine("b", takes_mode=False)
    EnginePool([with_mode, without]).pause()
    assert with_mode.calls == [("pause", "wait")] and without.calls == [("pause",)]
    EnginePool([with_mode]).pause("abort")
    assert with_mode.calls[-1] == ("pause", "abort")
    with pytest.raises(EngineError, match="b: pause.*'abort'"):
        EnginePool([with_mode, without]).pause("abort")
    with pytest.raises(ValueError, match="pause mode"):
        EnginePool([with_mode]).pause("later")


# ---- the collective transport rebuilds its groups among the survivors --------------------------


class GroupEngine:
    """An engine whose ranks are threads joining the real gloo groups of rollout/weights/group.py."""

    def __init__(self, name, ranks):
        self.name, self.ranks, self.dead = name, ranks, False
        self.joined_as: list[int] = []

    def weight_receivers(self):
        return self.ranks

    def join_weight_group(self, spec_json, offset):
        from megatron_rl.rollout.weights.group import GroupSpec, join_stage_group

        assert not self.dead, f"{self.name} is dead but was asked to join"
        spec = GroupSpec.from_json(spec_json)
        with ThreadPoolExecutor(max_workers=self.ranks) as threads:
            self.groups = list(threads.map(lambda rank: join_stage_group(spec, 0, offset + rank), range(self.ranks)))
        self.joined_as = [offset + rank for rank in range(self.ranks)]

    def receive_weights(self):
        from megatron_rl.rollout.weights.group import receive_stage

        if self.dead:
            raise EngineUnavailable(f"{self.name}: dead")

        def receive(group):
            return [(name, tensor.clone()) for name, tensor in receive_stage(group, torch.device("cpu"))]

        with ThreadPoolExecutor(max_workers=self.ranks) as threads:
            received = list(threads.map(receive, self.groups))
        assert all(len(r) == len(received[0]) for r in received)
        self.received = WeightDigest()  # what a real engine's worker digests (rollout/weights/digest.py)
        for _, tensor in received[0]:
            self.received.add(tensor)
        return len(received[0])

    def fingerprint(self):
        return {"received": self.received.to_dict(), "served_at_push": 0.0, "served_now": 0.0}


def test_collective_transport_rebuilds_its_groups_without_the_dead_engine(world, monkeypatch):
    from megatron_rl.rollout.weights import transport as transports

    monkeypatch.setattr(transports, "_stage_and_leader", lambda: (0, True))
    monkeypatch.setattr(transports, "_pipeline_stages", lambda: 1)
    transport = transports.CollectiveTransport(host="127.0.0.1", backend="gloo", bucket_bytes=1 << 10,
                                               timeout_s=15, port=free_port())
    engines = [GroupEngine("e0", 1), GroupEngine("e1", 2), GroupEngine("e2", 2)]
    weights = [(f"w{i}", torch.randn(40, 10)) for i in range(5)]
    transport.connect(list(engines))
    assert transport.push(iter(weights)) == 5
    assert [e.joined_as for e in engines] == [[1], [2, 3], [4, 5]]

    engines[1].dead = True
    transport.drop(["e1"])
    assert transport.spec.generation == 1 and transport.spec.world_size == 4
    assert engines[2].joined_as == [2, 3]  # renumbered
    assert transport.push(iter(weights)) == 5
    transport.drop(["e1"])  # already dropped: nothing collective happens
    assert transport.spec.generation == 1
    engines[0].dead = engines[2].dead = True
    with pytest.raises(EngineUnavailable, match="no live engine left"):
        transport.drop(["e1", "e0", "e2"])
    transport.close()
