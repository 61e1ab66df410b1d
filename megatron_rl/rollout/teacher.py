"""On-policy distillation's teacher behind a vLLM server: its log-probabilities of given tokens.

    teacher = TeacherServer.start(hf_dir, port=..., log_path=..., max_model_len=...)   # or TeacherServer(url)
    teacher.logprobs([(prompt_ids, response_ids), ...])   # per sequence: log pi_T of each response token

One completion request per sequence over prompt + response with vLLM's `prompt_logprobs`: the
log-probability of every prompt position's own token given the tokens before it, from the raw
logits (temperature 1: the teacher's own distribution, whatever the student samples at). The
request generates one token, which is thrown away, so the server's context must hold the
sequence plus one. The teacher server is started from real weights and never receives any.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megatron_rl.rollout.engines.http import JsonClient
from megatron_rl.rollout.engines.vllm_server import VllmServerEngine, VllmServerProcess
from megatron_rl.rollout.protocol import EngineError, EngineUnavailable


class TeacherServer:
    def __init__(self, url: str, *, name: str = "teacher", process: VllmServerProcess | None = None,
                 request_timeout_s: float = 600.0, max_retries: int = 2, max_concurrency: int = 32):
        self.name, self.url, self.process = name, url.rstrip("/"), process
        self.request_timeout_s, self.max_concurrency = request_timeout_s, max_concurrency
        self._client = JsonClient(name, self.url, timeout_s=request_timeout_s, max_retries=max_retries)
        self._client.get("/health", timeout_s=30, retries=1)
        model = self._client.get("/v1/models", timeout_s=30)["data"][0]
        self.model = model["id"]
        # vLLM reports the context it serves; a server that does not: unknown (checked per request).
        self.max_model_len: int | None = model.get("max_model_len")

    @classmethod
    def start(cls, model_dir: str | Path, *, port: int, log_path: str | Path, max_model_len: int, dtype: str,
              seed: int = 0, startup_timeout_s: float = 600.0, request_timeout_s: float = 600.0,
              cpu_kv_cache_gib: float = 1.0, gpu_memory_utilization: float = 0.5,
              extra_args: list[str] | None = None) -> TeacherServer:
        """A vLLM server of the teacher's own weights (`model_dir`, a Hugging Face directory) on this node."""
        process = VllmServerProcess.start(model_dir, port=port, log_path=log_path, name="teacher", dtype=dtype,
                                          max_model_len=max_model_len, seed=seed, cpu_kv_cache_gib=cpu_kv_cache_gib,
                                          gpu_memory_utilization=gpu_memory_utilization,
                                          startup_timeout_s=startup_timeout_s, extra_args=extra_args)
        try:
            return cls(process.url, process=process, request_timeout_s=request_timeout_s)
        except Exception:
            process.stop()
            raise

    def logprobs(self, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """For each (prompt ids, response ids): log pi_T(response[t] | prompt, response[:t]) for
        every response position, concurrently (at most max_concurrency requests in flight)."""
        if not sequences:
            return []
        with ThreadPoolExecutor(max_workers=min(len(sequences), self.max_concurrency)) as pool:
            futures = [pool.submit(self._score, prompt, response) for prompt, response in sequences]
            try:
                return [future.result() for future in futures]
            except EngineError:
                for future in futures:
                    future.cancel()
                self._raise_if_dead()
                raise

    def _score(self, prompt: list[int], response: list[int]) -> list[float]:
        if not response:
            return []
        tokens = list(prompt) + list(response)
        body = {"model": self.model, "prompt": tokens, "max_tokens": 1, "temperature": 1.0, "seed": 0,
                # 0: only each position's own token (no alternatives), from the raw logits
                "prompt_logprobs": 0}
        reply = self._client.post("/v1/completions", body, timeout_s=self.request_timeout_s)
        entries = reply["choices"][0].get("prompt_logprobs")
        if entries is None or len(entries) != len(tokens):
            raise EngineError(f"{self.name}: the server returned {None if entries is None else len(entries)} prompt "
                              f"logprobs for {len(tokens)} tokens (a vLLM without prompt_logprobs?)")
        return [_token_logprob(self.name, entries[position], tokens[position])
                for position in range(len(prompt), len(tokens))]

    def engine(self) -> VllmServerEngine:
        """The same server as a rollout engine that samples (the teacher's held-out evaluation)."""
        return VllmServerEngine(self.url, name=self.name, process=None, request_timeout_s=self.request_timeout_s)

    def _raise_if_dead(self) -> None:
        if self.process is not None and not self.process.alive():
            raise EngineUnavailable(f"{self.name}: server process exited with code {self.process.process.returncode}; "
                                    f"last lines of {self.process.log_path}:\n{self.process.log_tail()}")

    def shutdown(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None


def _token_logprob(name: str, entry: dict | None, token: int) -> float:
    """The logprob of `token` in one prompt_logprobs entry ({token id: {"logprob": ...}}, ids as
    JSON strings)."""
    if not entry or str(token) not in entry:
        raise EngineError(f"{name}: prompt_logprobs holds no value for token {token}")
    value = entry[str(token)]
    value = float(value["logprob"] if isinstance(value, dict) else value)
    if math.isnan(value):
        raise EngineError(f"{name}: the teacher's logprob of token {token} is NaN")
    return value
