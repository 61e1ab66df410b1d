"""The SGLang server engine against a fake SGLang server: a real HTTP server on a free port, in a thread.

Why a fake: SGLang cannot be installed or run on these machines (it pins a CUDA build of torch and
its kernel package ships GPU kernels only). The fake implements the endpoints the engine uses with
the request and response shapes of SGLang's documentation and source, and behaves consistently:
its "model" is a seeded function of (prompt, sampling_seed) and a pushed checkpoint is read back
from the files. What it cannot show is that a live SGLang server agrees; the engine's docstring
says so.
"""

from __future__ import annotations

import base64
import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from _support.processes import free_port
from _support.world import world  # noqa: F401  (the one-rank world the transports need)
from megatron_rl.config import load_config
from megatron_rl.errors import ConfigError
from megatron_rl.rollout.protocol import (CollectiveWeights, EngineError, EngineTimeout, EngineUnavailable, FileWeights,
                                         RolloutEngine, SamplingParams, supports)
from megatron_rl.rollout.engines.sglang import SglangServerEngine, SglangServerProcess
from megatron_rl.rollout.factory import check_sampling_logprobs

EOS = 2  # the fake model's end-of-sequence token
LAYERS, TOP_K = 2, 2  # shape of the fake routed experts


def fake_logprob(token: int) -> float:
    """The fake model's logprob of a token, so a test can check each logprob belongs to its token."""
    return -((token % 7) + 1) / 10


# The fake model's next-token logits over a 16-token vocabulary (for top logprobs).
NEXT_LOGITS = torch.tensor([((k * 5) % 16) / 4 for k in range(16)], dtype=torch.float64)


def top_logprobs(temperature: float, count: int, original: bool) -> list[list]:
    """SGLang's output_top_logprobs entry of one token: [logprob, token id, text] of the `count`
    most likely, after temperature (SGLang's default) or before it (`original`:
    SGLANG_RETURN_ORIGINAL_LOGPROB set)."""
    logprobs = torch.log_softmax(NEXT_LOGITS / (1.0 if original or temperature == 0 else temperature), dim=-1)
    values, ids = logprobs.topk(count)
    return [[float(value), int(token), None] for value, token in zip(values, ids)]


class FakeSglang:
    """Speaks the part of SGLang's native HTTP API the engine uses; records every request."""

    def __init__(self):
        self.requests: list[tuple[str, str, object]] = []
        self.delays: dict[str, float] = {}
        self.server_info = {"tp_size": 1, "enable_deterministic_inference": False, "version": "fake"}
        self.paused = False
        self.abort_generation = False
        self.fail_update: str | None = None
        self.weights: dict[str, torch.Tensor] = {}
        self.seen_checkpoint_files: list[str] = []
        self.weight_version = "0"
        self.return_original_logprob = False  # SGLANG_RETURN_ORIGINAL_LOGPROB on the server
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def do_GET(self):
                self._dispatch("GET", None)

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                self._dispatch("POST", json.loads(self.rfile.read(length) or b"null"))

            def _dispatch(self, method, body):
                fake.requests.append((method, self.path, body))
                time.sleep(fake.delays.get(self.path, 0.0))
                status, payload = fake.handle(method, self.path, body)
                data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "text/plain" if isinstance(payload, str) else "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (the timeout test)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()

    def bodies(self, path: str) -> list:
        return [body for _, request_path, body in self.requests if request_path == path]

    def paths(self) -> list[str]:
        return [path for _, path, _ in self.requests]

    # ---- endpoints ----------------------------------------------------------------------------

    def handle(self, method: str, path: str, body):
        routes = {
            ("GET", "/health"): lambda: (200, ""),
            ("GET", "/get_server_info"): lambda: (200, self.server_info),
            ("POST", "/generate"): lambda: self.generate(body),
            ("POST", "/update_weights_from_disk"): lambda: self.update_from_disk(body),
            # SGLang answers flush_cache with plain text, not JSON.
            ("POST", "/flush_cache"): lambda: (200, "Cache flushed.\nPlease check backend logs for more details.\n"),
            ("POST", "/pause_generation"): lambda: self.set_paused(True),
            ("POST", "/continue_generation"): lambda: self.set_paused(False),
        }
        route = routes.get((method, path))
        if route is None:
            return 404, {"object": "error", "message": f"no route {method} {path}", "code": 404}
        return route()

    def generate(self, body):
        prompts, all_params = body["input_ids"], body["sampling_params"]
        if isinstance(prompts[0], int):
            return 400, {"object": "error", "message": "the engine should always send a batch", "code": 400}
        rids = body.get("rid") or [f"r{index}" for index in range(len(prompts))]
        outputs = []
        for prompt, params, rid in zip(prompts, all_params, rids):
            for copy in range(params.get("n", 1)):
                output = self.complete(prompt, params, rid if params.get("n", 1) == 1 else f"{rid}-{copy}",
                                       body.get("return_routed_experts", False))
                if body.get("top_logprobs_num"):
                    top = top_logprobs(params["temperature"], body["top_logprobs_num"], self.return_original_logprob)
                    output["meta_info"]["output_top_logprobs"] = [top for _ in output["output_ids"]]
                outputs.append(output)
        # SGLang returns batch outputs in input order; reversed here to check that the engine
        # pairs outputs with requests by id, never by position.
        return 200, outputs[::-1]

    def complete(self, prompt: list[int], params: dict, rid: str, routed: bool) -> dict:
        """The fake model: prompt[0] content tokens then EOS, cut at max_new_tokens."""
        rng = random.Random(f"{params.get('sampling_seed')}:{prompt}")
        content = [rng.randrange(3, 1000) for _ in range(prompt[0])]
        limit = params["max_new_tokens"]
        if len(content) + 1 <= limit:
            tokens, finish = content + [EOS], {"type": "stop", "matched": EOS}
        else:
            tokens, finish = content[:limit], {"type": "length", "length": limit}
        if self.abort_generation:
            finish = {"type": "abort", "message": "Abort before prefill"}
        meta = {
            "id": rid, "prompt_tokens": len(prompt), "completion_tokens": len(tokens), "finish_reason": finish,
            "output_token_logprobs": [[fake_logprob(token), token, None] for token in tokens],
            "weight_version": self.weight_version,
        }
        if routed:
            positions = len(prompt) + len(tokens) - 1
            experts = torch.arange(positions * LAYERS * TOP_K, dtype=torch.int32) % 8
            meta["routed_experts"] = base64.b64encode(experts.numpy().tobytes()).decode()
        return {"text": "", "output_ids": tokens, "meta_info": meta}

    def update_from_disk(self, body):
        from safetensors.torch import load_file

        directory = Path(body["model_path"])
        self.seen_checkpoint_files = sorted(entry.name for entry in directory.iterdir())
        if self.fail_update:
            return 400, {"success": False, "message": self.fail_update, "num_paused_requests": 0}
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        loaded = {}
        for file_name in sorted(set(index["weight_map"].values())):
            loaded.update(load_file(str(directory / file_name)))
        if set(loaded) != set(index["weight_map"]):
            return 400, {"success": False, "message": "index does not match the shards", "num_paused_requests": 0}
        self.weights = loaded
        self.weight_version = body.get("weight_version", self.weight_version)
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def set_paused(self, paused: bool):
        self.paused = paused
        verb = "paused" if paused else "continued"
        return 200, {"message": f"Generation {verb} successfully.", "status": "ok"}


@pytest.fixture
def fake():
    server = FakeSglang()
    yield server
    server.stop()


def make_engine(fake: FakeSglang, staging: Path, **kwargs) -> SglangServerEngine:
    kwargs = {"staging_dir": staging, "max_retries": 0, "request_timeout_s": 30.0, **kwargs}
    return SglangServerEngine(fake.url, name="sglang-test", **kwargs)


def weight_stream() -> list[tuple[str, torch.Tensor]]:
    embed = torch.randn(6, 4)
    return [
        ("model.embed_tokens.weight", embed),
        ("lm_head.weight", embed),  # tied: shares storage with the embedding
        ("model.layers.0.mlp.experts.0.down_proj.weight", torch.randn(4, 8).to(torch.bfloat16)),
        ("model.norm.weight", torch.ones(4)),
    ]


def test_generate_groups_samples_and_sends_sglang_sampling_params(fake, tmp_path):
    """Two prompts, n=3: groups, order, finish reasons, logprobs, and the request bodies.

    A fake server stands in because SGLang cannot run here (CUDA-only torch and kernels)."""
    engine = make_engine(fake, tmp_path)
    assert isinstance(engine, RolloutEngine)
    prompts = [[3, 10, 11], [20, 12]]  # the fake stops after prompt[0] tokens: 3 fits in 8, 20 does not
    params = SamplingParams(n=3, temperature=0.7, top_p=0.9, max_tokens=8, stop=("###",), stop_token_ids=(5,),
                            seed=1234)

    groups = engine.generate(prompts, params)

    assert [len(group) for group in groups] == [3, 3]
    for index, group in enumerate(groups):
        for position, sample in enumerate(group):
            assert (sample.prompt_index, sample.sample_index) == (index, position)
            assert sample.prompt_token_ids == prompts[index]
            assert sample.logprobs == [fake_logprob(token) for token in sample.response_token_ids]
    assert [sample.finish_reason for sample in groups[0]] == ["stop"] * 3
    assert all(len(sample.response_token_ids) == 4 and sample.response_token_ids[-1] == EOS for sample in groups[0])
    assert [sample.finish_reason for sample in groups[1]] == ["length"] * 3
    assert all(len(sample.response_token_ids) == 8 for sample in groups[1])
    # Per-sample seeds: the samples of a group differ, and a replay regenerates them exactly.
    assert len({tuple(sample.response_token_ids) for sample in groups[1]}) == 3
    again = engine.generate(prompts, params)
    assert [[s.response_token_ids for s in g] for g in again] == [[s.response_token_ids for s in g] for g in groups]

    bodies = fake.bodies("/generate")[:2]
    assert sorted(body["input_ids"][0] for body in bodies) == sorted(prompts)
    for body in bodies:
        index = prompts.index(body["input_ids"][0])
        assert body["input_ids"] == [prompts[index]] * 3
        assert body["return_logprob"] is True and body["logprob_start_len"] == -1
        assert len(body["rid"]) == 3
        seeds = [params.for_prompt(index).prompt_seed(position) for position in range(3)]
        assert body["sampling_params"] == [
            {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 8, "n": 1, "stop": ["###"], "stop_token_ids": [5],
             "sampling_seed": seed}
            for seed in seeds
        ]
    all_seeds = [sp["sampling_seed"] for body in bodies for sp in body["sampling_params"]]
    assert len(set(all_seeds)) == 6


def test_routed_experts_are_decoded_per_position(fake, tmp_path):
    """Routed experts (base64 int32) become [positions, layers * top_k] in Sample.extras.

    A fake server stands in because SGLang cannot run here (CUDA-only torch and kernels)."""
    engine = make_engine(fake, tmp_path, return_routed_experts=True)
    [[sample]] = engine.generate([[2, 7, 7, 7]], SamplingParams(n=1, max_tokens=8, seed=1))

    assert fake.bodies("/generate")[0]["return_routed_experts"] is True
    positions = len(sample.prompt_token_ids) + len(sample.response_token_ids) - 1
    experts = sample.extras["routed_experts"]
    assert experts.dtype == torch.int32 and experts.shape == (positions, LAYERS * TOP_K)
    assert torch.equal(experts.flatten(), torch.arange(positions * LAYERS * TOP_K, dtype=torch.int32) % 8)


def test_update_weights_from_disk_writes_checkpoint_flushes_and_cleans_up(fake, tmp_path):
    """The disk transport writes an HF safetensors checkpoint the server reads back, flushes the
    prefix cache after the reload, and deletes the files.

    A fake server stands in because SGLang cannot run here (CUDA-only torch and kernels); it
    loads the pushed files with safetensors, so the bytes on disk are what is checked."""
    staging = tmp_path / "staging"
    config_dir = tmp_path / "hf"
    config_dir.mkdir()
    (config_dir / "config.json").write_text('{"model_type": "qwen3_moe"}')
    engine = make_engine(fake, staging, hf_config_dir=config_dir)
    stream = weight_stream()

    loaded = engine.update_weights(iter(stream), bucket_bytes=64)  # small buckets: several shards

    assert loaded == len(stream)
    assert set(fake.weights) == {name for name, _ in stream}
    for name, tensor in stream:
        assert fake.weights[name].dtype == tensor.dtype and torch.equal(fake.weights[name], tensor)
    [body] = fake.bodies("/update_weights_from_disk")
    assert Path(body["model_path"]).parent == staging and body["flush_cache"] is True
    assert "config.json" in fake.seen_checkpoint_files and "model.safetensors.index.json" in fake.seen_checkpoint_files
    assert sum(name.endswith(".safetensors") for name in fake.seen_checkpoint_files) > 1
    paths = fake.paths()
    assert paths.index("/flush_cache") > paths.index("/update_weights_from_disk")
    assert list(staging.iterdir()) == []
    # Samples generated afterwards carry the server's weight version.
    [[sample]] = engine.generate([[1, 4]], SamplingParams(max_tokens=4, seed=0))
    assert sample.extras["weight_version"] == body["weight_version"]


def test_rejected_disk_update_raises_server_message_and_cleans_up(fake, tmp_path):
    """An HTTP 400 from the server becomes an EngineError naming the engine and quoting the server.

    A fake server stands in because SGLang cannot run here (CUDA-only torch and kernels)."""
    engine = make_engine(fake, tmp_path)
    fake.fail_update = "Failed to update weights: shape mismatch for model.norm.weight"

    with pytest.raises(EngineError, match=r"sglang-test.*HTTP 400.*shape mismatch for model.norm.weight"):
        engine.update_weights(iter(weight_stream()))

    assert "/flush_cache" not in fake.paths()
    assert list(tmp_path.iterdir()) == []


def test_a_run_configured_for_sglang_takes_weights_through_the_files_transport_only(fake, tmp_path, world):
    """What a run with `rollout.engine: sglang` builds (rollout/factory.py): its engines and the
    files transport, the one weight path SGLang has; every other transport is refused by name
    before anything starts.

    A fake server stands in because SGLang cannot run here (CUDA-only torch and kernels)."""
    from megatron_rl.rollout.factory import build_engines, build_transport

    sglang = ["rollout.engine=sglang", "rollout.mode=server", f"rollout.server_urls=[{fake.url}]",
              f"output_dir={tmp_path}"]
    config = load_config(None, sglang)
    [engine] = build_engines(config, tmp_path / "hf", local_rank=0, seed=0)
    transport = build_transport(config, "127.0.0.1")
    assert transport.name == "files"
    transport.connect([engine])
    stream = weight_stream()
    assert transport.push(iter(stream)) == len(stream)
    for name, tensor in stream:
        assert torch.equal(fake.weights[name], tensor)
    assert fake.paths().count("/update_weights_from_disk") == 1 and fake.paths()[-1] == "/flush_cache"
    for kind in ("collective", "nccl"):
        with pytest.raises(ConfigError, match=f"weight_transport={kind}: SGLang servers take weights through files"):
            load_config(None, [*sglang, f"rollout.weight_transport={kind}"])
    for kind in ("distributed", "tensor"):  # the engine's own transports before issue 43: gone, and never config values
        with pytest.raises(ConfigError, match=f"rollout.weight_transport.*{kind}"):
            load_config(None, [*sglang, f"rollout.weight_transport={kind}"])
    assert supports(engine, FileWeights) and not supports(engine, CollectiveWeights)  # protocol.py's capabilities


def test_pause_and_resume_hit_their_endpoints(fake, tmp_path):
    """pause() and resume() call /pause_generation (mode abort) and /continue_generation.

    A fake server stands in because SGLang cannot run here (CUDA-only torch and kernels)."""
    engine = make_engine(fake, tmp_path)
    engine.pause()
    assert fake.paused and fake.bodies("/pause_generation") == [{"mode": "abort"}]
    engine.resume()
    assert not fake.paused and fake.bodies("/continue_generation") == [{}]


def test_aborted_request_raises(fake, tmp_path):
    """A request that ends with finish reason "abort" (e.g. cut by a pause) is an error, not a sample.

    A fake server stands in because SGLang cannot run here (CUDA-only torch and kernels)."""
    engine = make_engine(fake, tmp_path)
    fake.abort_generation = True
    with pytest.raises(EngineError, match="sglang-test.*'abort'.*Abort before prefill"):
        engine.generate([[2, 5]], SamplingParams(seed=0))


def test_deterministic_server_without_seed_is_refused(fake, tmp_path):
    """Under deterministic inference, unseeded samples of one prompt would be identical; refused.

    A fake server stands in because SGLang cannot run here (CUDA-only torch and kernels)."""
    fake.server_info["enable_deterministic_inference"] = True
    engine = make_engine(fake, tmp_path)
    with pytest.raises(EngineError, match="sglang-test.*identical"):
        engine.generate([[2, 5]], SamplingParams(n=4))
    assert engine.generate([[2, 5]], SamplingParams(n=4, seed=3))[0][3].sample_index == 3


def test_dead_server_raises_unavailable_naming_the_engine(fake, tmp_path):
    """A stopped server is EngineUnavailable, and the message names the engine.

    A fake server stands in because SGLang cannot run here (CUDA-only torch and kernels)."""
    engine = make_engine(fake, tmp_path)
    fake.stop()
    with pytest.raises(EngineUnavailable, match="sglang-test"):
        engine.generate([[2, 5]], SamplingParams(seed=0))
    with pytest.raises(EngineUnavailable, match="sglang-test"):
        engine.health()


def test_slow_generate_raises_timeout_within_the_limit(fake, tmp_path):
    """A /generate slower than the timeout is EngineTimeout, raised after about the timeout.

    A fake server stands in because SGLang cannot run here (CUDA-only torch and kernels)."""
    engine = make_engine(fake, tmp_path)
    fake.delays["/generate"] = 5.0
    started = time.monotonic()
    with pytest.raises(EngineTimeout, match="sglang-test.*/generate timed out"):
        engine.generate([[2, 5]], SamplingParams(seed=0), timeout_s=0.5)
    assert time.monotonic() - started < 2.5


def test_a_server_whose_logprobs_ignore_the_temperature_is_refused_at_start(fake, tmp_path):
    """SGLang returns log softmax(logits / T) unless its server runs with
    SGLANG_RETURN_ORIGINAL_LOGPROB set; no endpoint says which, so at rl.temperature != 1 the run
    measures it when it builds its engines (the spread of one token's top logprobs at T and at 1)
    and refuses such a server by name. At temperature 1 the two are the same and nothing is asked.

    A fake server stands in because SGLang cannot run here (CUDA-only torch and kernels); it
    answers both ways, so this shows the measurement and the refusal, not a live server's answer."""
    engine = make_engine(fake, tmp_path)
    tempered = load_config(None, ["rl.temperature=0.6"])
    check_sampling_logprobs(tempered, [engine])
    probes = fake.bodies("/generate")
    assert [body["sampling_params"][0]["temperature"] for body in probes] == [1.0, 0.6]
    assert all(body["top_logprobs_num"] == 8 and body["return_logprob"] for body in probes)

    fake.return_original_logprob = True
    with pytest.raises(EngineError, match=r"sglang-test: the server returns logprobs before temperature .* restart "
                                          r"it without SGLANG_RETURN_ORIGINAL_LOGPROB"):
        check_sampling_logprobs(tempered, [engine])
    asked = len(fake.bodies("/generate"))
    check_sampling_logprobs(load_config(None, []), [engine])
    assert len(fake.bodies("/generate")) == asked


def test_servers_we_start_return_logprobs_after_temperature(monkeypatch, tmp_path):
    """SglangServerProcess.start clears SGLANG_RETURN_ORIGINAL_LOGPROB for its server, even when
    this process has it set."""
    captured = {}

    def launch(cls, command, *, env, **kwargs):
        captured.update(env)
        return None

    monkeypatch.setattr(SglangServerProcess, "launch", classmethod(launch))
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "true")
    SglangServerProcess.start(tmp_path / "model", port=free_port(), log_path=tmp_path / "sglang.log")
    assert captured["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "false"
