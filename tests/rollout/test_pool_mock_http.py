"""Data-parallel rollout over several vLLM server engines, against fake OpenAI-compatible servers.

Why fakes: the behaviour under test is the pool's and the HTTP client's (splitting prompts across
engines and putting results back in order, per-prompt seeds independent of the split, a dead
engine's prompts moved to the live ones, timeouts and bounded retries). Killing or stalling a real
vLLM server on cue takes minutes per case on 2 cores; its request and response shapes are
exercised live by tests/rollout/test_vllm_sync.py (server mode), and one server killed with
requests in flight by tests/rollout/test_engine_failover.py. Each fake answers /v1/completions deterministically
from (prompt, seed), so the samples say which seed produced them.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from _support.processes import free_port
from megatron_rl.config import load_config
from megatron_rl.rollout import EnginePool, EngineTimeout, EngineUnavailable, SamplingParams
from megatron_rl.rollout.factory import check_sampling_logprobs
from megatron_rl.rollout.protocol import EngineError
from megatron_rl.rollout.engines.vllm_server import VllmServerEngine


class FakeVllm:
    def __init__(self, delay_s: float = 0.0, fail_with: int | None = None, logprobs_mode: str = "processed_logprobs"):
        self.delay_s, self.fail_with = delay_s, fail_with
        self.logprobs_mode = logprobs_mode  # what its "workers" answer sampler_logprobs_mode with
        self.completions = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, payload):
                body = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/health":
                    return self._send(200, {})
                if self.path == "/v1/models":
                    return self._send(200, {"data": [{"id": "tiny"}]})
                self._send(404, {"error": "no route"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/collective_rpc" and body["method"] == "sampler_logprobs_mode":
                    return self._send(200, {"results": [fake.logprobs_mode] * 2})  # two workers
                if self.path != "/v1/completions":
                    return self._send(404, {"error": "no route"})
                fake.completions += 1
                time.sleep(fake.delay_s)
                if fake.fail_with:
                    return self._send(fake.fail_with, {"error": "overloaded"})
                seed, prompt = body["seed"], body["prompt"]
                choices = []
                for index in reversed(range(body["n"])):  # out of order on purpose
                    tokens = [prompt[0], seed % 1000, index][: body["max_tokens"]]
                    choices.append({"index": index, "token_ids": tokens, "finish_reason": "length",
                                    "logprobs": {"token_logprobs": [-0.5] * len(tokens)}})
                self._send(200, {"choices": choices})

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fakes():
    servers = []

    def make(**kwargs):
        servers.append(FakeVllm(**kwargs))
        return servers[-1]

    yield make
    for server in servers:
        server.stop()


def engine(fake, name, **kwargs):
    return VllmServerEngine(fake.url, name=name, max_retries=kwargs.pop("max_retries", 1), **kwargs)


PROMPTS = [[10 + i, 1, 2] for i in range(7)]


def test_mock_pool_keeps_prompt_order_and_split_independent_seeds(fakes):
    """Why a mock: see the module docstring."""
    params = SamplingParams(n=3, max_tokens=3, seed=42)
    single = engine(fakes(), "vllm-solo").generate(PROMPTS, params)
    pool = EnginePool([engine(fakes(), f"vllm-{i}") for i in range(3)])
    split = pool.generate(PROMPTS, params)
    assert [[s.response_token_ids for s in g] for g in split] == [[s.response_token_ids for s in g] for g in single]
    for index, group in enumerate(split):
        assert [(s.prompt_index, s.sample_index) for s in group] == [(index, j) for j in range(3)]
        assert group[0].response_token_ids[0] == PROMPTS[index][0]
    # Every prompt got its own seed.
    assert len({g[0].response_token_ids[1] for g in split}) == len(PROMPTS)


def test_mock_pool_moves_a_dead_engines_prompts_and_names_every_dead_engine(fakes):
    """Why a mock: see the module docstring."""
    params = SamplingParams(n=2, max_tokens=3, seed=1)
    live, dead = fakes(), fakes()
    pool = EnginePool([engine(live, "vllm-0"), engine(dead, "vllm-1", max_retries=0)])
    dead.stop()
    groups = pool.generate(PROMPTS, params)
    reference = engine(fakes(), "vllm-solo").generate(PROMPTS, params)
    assert [[s.response_token_ids for s in g] for g in groups] == [[s.response_token_ids for s in g] for g in reference]
    assert pool.dead == ["vllm-1"] and [e.name for e in pool.live] == ["vllm-0"]
    pool.health()  # the dead engine is no longer asked
    live.stop()
    with pytest.raises(EngineUnavailable, match="no live engine left.*vllm-1.*vllm-0") as info:
        pool.generate(PROMPTS, params)
    assert "Connection refused" in str(info.value)
    assert pool.dead == ["vllm-1", "vllm-0"]


def test_mock_engine_timeout_is_bounded(fakes):
    """Why a mock: see the module docstring."""
    slow = fakes(delay_s=2.0)
    client = engine(slow, "vllm-slow", max_retries=1)
    started = time.monotonic()
    with pytest.raises(EngineTimeout, match="vllm-slow.*timed out after 0s.*2 attempts"):
        client.generate(PROMPTS[:1], SamplingParams(seed=3), timeout_s=0.3)
    assert time.monotonic() - started < 3.0
    assert slow.completions == 2  # one try and one bounded retry


def test_mock_transient_errors_are_retried_a_bounded_number_of_times(fakes):
    """Why a mock: see the module docstring."""
    busy = fakes(fail_with=503)
    client = engine(busy, "vllm-busy", max_retries=2)
    with pytest.raises(Exception, match="vllm-busy.*HTTP 503.*3 attempts"):
        client.generate(PROMPTS[:1], SamplingParams(seed=3))
    assert busy.completions == 3


def test_a_server_whose_logprobs_ignore_the_temperature_is_refused_at_start(fakes):
    """A vLLM server started elsewhere without --logprobs-mode processed_logprobs returns
    softmax(logits)'s logprobs at any temperature; at rl.temperature=0.6 the run refuses it by name
    when it builds its engines (rollout/factory.py), at 1 the two are the same and it is kept.
    Why a mock: only the engine's question and the refusal are under test; that a real server
    started by us answers processed_logprobs and returns them is tests/rollout/test_vllm_sync.py."""
    raw, processed = engine(fakes(logprobs_mode="raw_logprobs"), "vllm-raw"), engine(fakes(), "vllm-0")
    tempered = load_config(None, ["rl.temperature=0.6"])
    with pytest.raises(EngineError, match=r"vllm-raw: the server returns 'raw_logprobs' logprobs, which ignore "
                                          r"the sampling temperature 0.6 .*--logprobs-mode processed_logprobs"):
        check_sampling_logprobs(tempered, [processed, raw])
    check_sampling_logprobs(tempered, [processed])
    check_sampling_logprobs(load_config(None, []), [raw])
