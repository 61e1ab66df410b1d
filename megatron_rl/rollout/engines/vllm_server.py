"""vLLM as an OpenAI-compatible HTTP server (a separate process, on this node or another).

    server = VllmServerProcess.start(model_dir, port=8100, log_path=run_dir / "vllm-0.log", ...)
    engine = VllmServerEngine(server.url, name="vllm-0", process=server, staging_dir=...)

The server is `python -m vllm.entrypoints.openai.api_server` (the `vllm serve` entry point fails
its package-metadata lookup on the CPU build) with `VLLM_SERVER_DEV_MODE=1`, which exposes
`/collective_rpc` and `/reset_prefix_cache`, and our worker extension for weight loading.

Weights arrive through a transport (rollout/weights/transport.py) calling the engine-side methods below,
each a `/collective_rpc` into our worker extension: `load_weight_files` (files on a shared
filesystem), `weight_receivers` / `join_weight_group` / `receive_weights` (collective: gloo on
CPU, NCCL on GPU; rollout/worker/receiver.py is the workers' side). `update_weights(stream)` is a
whole files push for callers holding one engine.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from megatron_rl.rollout.auth import MIDDLEWARE, TOKEN_ENV, ensure_rollout_token
from megatron_rl.rollout.engines.http import JsonClient
from megatron_rl.rollout.engines.server_process import ServerEngineBase, ServerProcess
from megatron_rl.rollout.protocol import (
    EngineError,
    Sample,
    SamplingParams,
    WeightStream,
)
from megatron_rl.rollout.worker.route_capture import ROUTE_CAPTURE_KEY, attach_captured_routes, native_routes, new_tags
from megatron_rl.rollout.engines.vllm_common import (
    LOGPROBS_MODE,
    check_logprobs_mode,
    cpu_kernel_flags,
    finish_reason,
    vllm_environment,
)
from megatron_rl.rollout.worker.extension import WORKER_EXTENSION


class VllmServerProcess(ServerProcess):
    """A vLLM server we started; owns the process and its log file."""

    @classmethod
    def start(
        cls, model_dir: str | Path, *, port: int, log_path: str | Path, name: str = "vllm-server",
        host: str = "127.0.0.1", dtype: str = "float32", max_model_len: int = 1024, seed: int = 0,
        cache_dir: str | Path | None = None, cpu_kv_cache_gib: float = 1.0, gpu_memory_utilization: float = 0.5,
        load_format: str = "auto", startup_timeout_s: float = 600.0,
        extra_args: list[str] | None = None, python: str | None = None, extra_env: dict[str, str] | None = None,
    ) -> VllmServerProcess:
        """`python -m vllm.entrypoints.openai.api_server` for `model_dir`, healthy when it returns.
        `python`: the interpreter to run it with (default: this process's); `extra_env`: variables
        set for the server over this process's environment."""
        on_cpu = not torch.cuda.is_available()
        env = dict(os.environ)
        env.update(vllm_environment(cache_dir, on_cpu=on_cpu, kv_cache_gib=cpu_kv_cache_gib))
        env.update(extra_env or {})
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc and /reset_prefix_cache
        env[TOKEN_ENV] = ensure_rollout_token()  # the server reads it, our clients send it (rollout/auth.py)
        command = [
            python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--host", host, "--port", str(port),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", str(seed),
            "--load-format", load_format, "--worker-extension-cls", WORKER_EXTENSION,
            "--gpu-memory-utilization", str(gpu_memory_utilization),
            "--middleware", MIDDLEWARE,  # every route but /health needs the job's token
            "--logprobs-mode", LOGPROBS_MODE,  # logprobs after temperature: what the trainer trains on
        ]
        if on_cpu:
            command.append("--enforce-eager")
            command += cpu_kernel_flags(model_dir, dtype)
        command += extra_args or []
        if on_cpu and _backend(command) == "uni":
            # vLLM's CPU platform turns `uni` into `mp` while V1 multiprocessing is on, spawning a
            # process for the one worker (one more start-up import of torch and vLLM). The server's
            # engine core runs in its own process either way (AsyncLLM); with this off the worker
            # runs inside it, as `uni` asks.
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        return cls.launch(command, env=env, url=f"http://{host}:{port}", log_path=log_path, name=name,
                          startup_timeout_s=startup_timeout_s, served_model=str(model_dir))


def _backend(command: list[str]) -> str | None:
    """The server's --distributed-executor-backend (the last one given, either spelling)."""
    flag, backend = "--distributed-executor-backend", None
    for arg, following in zip(command, command[1:] + [None]):
        if arg == flag:
            backend = following
        elif arg.startswith(flag + "="):
            backend = arg.split("=", 1)[1]
    return backend


class VllmServerEngine(ServerEngineBase):
    def __init__(
        self, url: str, *, name: str = "vllm-server", process: VllmServerProcess | None = None,
        staging_dir: str | Path | None = None, request_timeout_s: float = 900.0, max_retries: int = 2,
        max_concurrency: int = 64,
    ):
        self.name, self.url, self.process = name, url.rstrip("/"), process
        self.staging_dir = Path(staging_dir) if staging_dir else None
        self.request_timeout_s, self.max_concurrency = request_timeout_s, max_concurrency
        self._client = JsonClient(name, url, timeout_s=request_timeout_s, max_retries=max_retries)
        self._pushes = 0
        self._closed = False
        self.health()
        models = self._client.get("/v1/models", timeout_s=30)
        self.model = models["data"][0]["id"]

    # ---- generation ---------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams, timeout_s: float | None = None) -> list[list[Sample]]:
        timeout = timeout_s or self.request_timeout_s
        if not prompts:
            return []
        if params.return_routed_experts:
            self._route_layout()  # before the concurrent requests
        # One request per prompt: each carries its own seed, so results do not depend on batching.
        return self._per_prompt(self._complete, prompts, params, timeout)

    def _complete(self, index: int, prompt: list[int], params: SamplingParams, timeout: float) -> list[Sample]:
        body = {
            "model": self.model,
            "prompt": list(prompt),
            "n": params.n,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_tokens_of(index),
            "seed": params.prompt_seed(index),
            "logprobs": 0,  # the sampled token's own logprob
            "return_token_ids": True,
        }
        if params.stop:
            body["stop"] = list(params.stop)
        if params.stop_token_ids:
            body["stop_token_ids"] = list(params.stop_token_ids)
        if params.ignore_eos:
            body["ignore_eos"] = True
        # R3: the engine's MoE routes (rollout/worker/route_capture.py). vLLM's GPU build with
        # --enable-return-routed-experts returns them per choice; otherwise our worker extension
        # captures the requests tagged through vllm_xargs (its SamplingParams.extra_args).
        layout = self._route_layout() if params.return_routed_experts else None
        tag = new_tags(1)[0] if layout is not None and not layout["native"] else None
        if tag is not None:
            body["vllm_xargs"] = {ROUTE_CAPTURE_KEY: tag}
        response = self._client.post("/v1/completions", body, timeout_s=timeout)
        choices = sorted(response["choices"], key=lambda choice: choice["index"])
        samples = []
        for position, choice in enumerate(choices):
            token_ids = choice.get("token_ids")
            if token_ids is None:
                raise EngineError(f"{self.name}: server did not return token ids (vLLM too old for return_token_ids?)")
            logprobs = [float(value) for value in (choice.get("logprobs") or {}).get("token_logprobs", [])]
            samples.append(Sample(index, position, list(prompt), list(token_ids), logprobs,
                                  finish_reason(self.name, choice.get("finish_reason"), partial=params.partial)))
            if layout is not None and tag is None:
                samples[-1].extras["routed_experts"] = native_routes(self.name, samples[-1],
                                                                     choice.get("routed_experts"), layout["layers"])
        if tag is not None:
            # Not retried: the worker hands a tag's routes out once.
            take = {"method": "route_capture_take", "args": [json.dumps([tag])]}
            captured = self._client.post("/collective_rpc", take, timeout_s=timeout, retries=0)["results"][0]
            attach_captured_routes(self.name, samples, captured[tag], params.n)
        return samples

    def _route_layout(self) -> dict:
        """The server's route capture, started on first use (route_capture.RouteCaptureWorker)."""
        layout = getattr(self, "_routes", None)
        if layout is None:
            layout = self._client.post("/collective_rpc", {"method": "route_capture_enable"})["results"][0]
            if not layout["native"]:
                self._client.post("/reset_prefix_cache")  # no cached prefix may predate the capture
            self._routes = layout
        return layout

    # ---- weights ------------------------------------------------------------------------------

    def update_weights(self, weights: WeightStream, *, bucket_bytes: int = 512 << 20) -> int:
        """A whole push through files in `staging_dir` (the files transport for one engine)."""
        from megatron_rl.rollout.weights.transport import write_safetensors_dir

        if self.staging_dir is None:
            raise EngineError(f"{self.name}: no staging_dir for the files weight transport")
        self._pushes += 1
        push_dir = self.staging_dir / f"{self.name}-push-{self._pushes:06d}"
        try:
            if write_safetensors_dir(weights, push_dir, bucket_bytes) == 0:
                raise EngineError(f"{self.name}: weight update received no tensors")
            count = self.load_weight_files(str(push_dir))
            self.reset_prefix_cache()
        finally:
            shutil.rmtree(push_dir, ignore_errors=True)
        return count

    def load_weight_files(self, directory: str) -> int:
        """Every worker reloads the whole model from the directory's safetensors files, in one call."""
        index = json.loads((Path(directory) / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        paths = [str(Path(directory) / name) for name in files]
        return self._same_on_every_worker("update_weights_from_files", json.dumps(paths))

    def weight_receivers(self) -> int:
        ranks = sorted(int(rank) for rank in self._rpc("weight_receiver_rank"))
        if ranks != list(range(len(ranks))):
            raise EngineError(f"{self.name}: workers report ranks {ranks}, expected 0..{len(ranks) - 1}")
        return len(ranks)

    def join_weight_group(self, spec_json: str, rank_offset: int) -> None:
        self._rpc("join_weight_group", spec_json, int(rank_offset))

    def receive_weights(self) -> int:
        return self._same_on_every_worker("receive_weights")

    def reset_prefix_cache(self) -> None:
        self._client.post("/reset_prefix_cache")

    def _rpc(self, method: str, *args) -> list:
        """`method` on every worker of the server (our worker extension), through /collective_rpc.
        Never retried: a weight load or a group join must not run twice."""
        return self._client.post("/collective_rpc", {"method": method, "args": list(args)}, retries=0)["results"]

    def _same_on_every_worker(self, method: str, *args) -> int:
        counts = {int(result) for result in self._rpc(method, *args)}
        if len(counts) != 1:
            raise EngineError(f"{self.name}: workers loaded different tensor counts {sorted(counts)}")
        count = counts.pop()
        if count == 0:
            raise EngineError(f"{self.name}: weight update delivered no tensors")
        return count

    def fingerprint(self) -> dict:
        return self._rpc("weights_fingerprint")[0]

    def check_sampling_logprobs(self, temperature: float) -> None:
        """Refuse a server whose returned logprobs ignore `temperature` (vLLM's logprobs_mode, as
        its workers run it; a server started elsewhere may lack our --logprobs-mode)."""
        for mode in set(self._rpc("sampler_logprobs_mode")):
            check_logprobs_mode(self.name, mode, temperature)

    # ---- lifecycle ----------------------------------------------------------------------------

    def pause(self, mode: str = "wait") -> None:
        """New requests are held until resume. In-flight ones: "wait" lets them finish; "abort"
        ends them at once, each returning the tokens it has (partial rollouts continue them on
        the new weights). Either way the KV cache is cleared, so nothing computed with the old
        weights is reused."""
        if mode not in ("wait", "abort"):
            raise ValueError(f"{self.name}: pause mode must be 'wait' or 'abort', got {mode!r}")
        self._client.post("/pause", params=f"mode={mode}")

    def resume(self) -> None:
        self._client.post("/resume")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.process is not None:
            self.process.stop()
