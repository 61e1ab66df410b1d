"""vLLM as an OpenAI-compatible HTTP server (a separate process, on this node or another).

    server = VllmServerProcess.start(model_dir, port=8100, log_path=run_dir / "vllm-0.log", ...)
    engine = VllmServerEngine(server.url, name="vllm-0", process=server, staging_dir=...)

The server is `python -m vllm.entrypoints.openai.api_server` (the `vllm serve` entry point fails
its package-metadata lookup on the CPU build) with `VLLM_SERVER_DEV_MODE=1`, which exposes
`/collective_rpc` and `/reset_prefix_cache`, and our worker extension for weight loading.

Weight transports:
- "files" (CPU, or any setup with a filesystem shared by trainer and server): trainer rank 0
  writes safetensors buckets to a staging directory and asks the workers to reload from them in
  one call; the files are deleted afterwards.
- "nccl" (GPU): see `megatron_rl.rollout.nccl_transport` (untested on these machines).
After either, the prefix cache is reset.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from megatron_rl.bridge.export import buckets
from megatron_rl.rollout.http import JsonClient
from megatron_rl.rollout.server_process import ServerEngineBase, ServerProcess
from megatron_rl.rollout.protocol import (
    EngineError,
    Sample,
    SamplingParams,
    WeightStream,
)
from megatron_rl.rollout.vllm_common import finish_reason, vllm_environment
from megatron_rl.rollout.vllm_worker import WORKER_EXTENSION


class VllmServerProcess(ServerProcess):
    """A vLLM server we started; owns the process and its log file."""

    @classmethod
    def start(
        cls, model_dir: str | Path, *, port: int, log_path: str | Path, name: str = "vllm-server",
        host: str = "127.0.0.1", dtype: str = "float32", max_model_len: int = 1024, seed: int = 0,
        cache_dir: str | Path | None = None, cpu_kv_cache_gib: float = 1.0, gpu_memory_utilization: float = 0.5,
        load_format: str = "auto", weight_transfer: str | None = None, startup_timeout_s: float = 600.0,
        extra_args: list[str] | None = None,
    ) -> VllmServerProcess:
        on_cpu = not torch.cuda.is_available()
        env = dict(os.environ)
        env.update(vllm_environment(cache_dir, on_cpu=on_cpu, kv_cache_gib=cpu_kv_cache_gib))
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc and /reset_prefix_cache
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--host", host, "--port", str(port),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", str(seed),
            "--load-format", load_format, "--worker-extension-cls", WORKER_EXTENSION,
            "--gpu-memory-utilization", str(gpu_memory_utilization),
        ]
        if on_cpu:
            command.append("--enforce-eager")
        if weight_transfer:
            command += ["--weight-transfer-config", json.dumps({"backend": weight_transfer})]
        command += extra_args or []
        return cls.launch(command, env=env, url=f"http://{host}:{port}", log_path=log_path, name=name,
                          startup_timeout_s=startup_timeout_s)

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
        # One request per prompt: each carries its own seed, so results do not depend on batching.
        return self._per_prompt(self._complete, prompts, params, timeout)

    def _complete(self, index: int, prompt: list[int], params: SamplingParams, timeout: float) -> list[Sample]:
        body = {
            "model": self.model,
            "prompt": list(prompt),
            "n": params.n,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_tokens,
            "seed": params.prompt_seed(index),
            "logprobs": 0,  # the sampled token's own logprob
            "return_token_ids": True,
        }
        if params.stop:
            body["stop"] = list(params.stop)
        if params.stop_token_ids:
            body["stop_token_ids"] = list(params.stop_token_ids)
        response = self._client.post("/v1/completions", body, timeout_s=timeout)
        choices = sorted(response["choices"], key=lambda choice: choice["index"])
        samples = []
        for position, choice in enumerate(choices):
            token_ids = choice.get("token_ids")
            if token_ids is None:
                raise EngineError(f"{self.name}: server did not return token ids (vLLM too old for return_token_ids?)")
            logprobs = [float(value) for value in (choice.get("logprobs") or {}).get("token_logprobs", [])]
            extras = {"routed_experts": choice["routed_experts"]} if choice.get("routed_experts") else {}
            samples.append(Sample(index, position, list(prompt), list(token_ids), logprobs,
                                  finish_reason(self.name, choice.get("finish_reason")), extras))
        return samples

    # ---- weights ------------------------------------------------------------------------------

    def update_weights(self, weights: WeightStream, *, bucket_bytes: int = 512 << 20) -> int:
        """Files transport: write the stream as safetensors buckets, reload from them in one call."""
        from safetensors.torch import save_file

        if self.staging_dir is None:
            raise EngineError(f"{self.name}: no staging_dir for the files weight transport")
        self._pushes += 1
        push_dir = self.staging_dir / f"{self.name}-push-{self._pushes:06d}"
        shutil.rmtree(push_dir, ignore_errors=True)
        push_dir.mkdir(parents=True)
        try:
            paths = []
            for index, bucket in enumerate(buckets(weights, bucket_bytes)):
                path = push_dir / f"bucket-{index:05d}.safetensors"
                save_file({name: tensor.detach().contiguous().cpu() for name, tensor in bucket}, str(path))
                paths.append(str(path))
            if not paths:
                raise EngineError(f"{self.name}: weight update received no tensors")
            results = self._client.post("/collective_rpc", {
                "method": "update_weights_from_files", "args": [json.dumps(paths)],
            })["results"]
            self._client.post("/reset_prefix_cache")
        finally:
            shutil.rmtree(push_dir, ignore_errors=True)
        counts = {int(result) for result in results}
        if len(counts) != 1:
            raise EngineError(f"{self.name}: workers loaded different tensor counts {sorted(counts)}")
        return counts.pop()

    def fingerprint(self) -> dict:
        return self._client.post("/collective_rpc", {"method": "weights_fingerprint"})["results"][0]

    # ---- lifecycle ----------------------------------------------------------------------------

    def pause(self) -> None:
        # "wait": in-flight requests finish; new ones are held until resume.
        self._client.post("/pause", params="mode=wait")

    def resume(self) -> None:
        self._client.post("/resume")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.process is not None:
            self.process.stop()
