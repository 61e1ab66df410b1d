"""On-policy distillation's teacher behind a vLLM server: its log-probabilities of given tokens.

    teacher = TeacherServer.start(hf_dir, port=..., log_path=..., max_model_len=...)   # or TeacherServer(url)
    teacher.logprobs([(prompt_ids, response_ids), ...])   # per sequence: log pi_T of each response token

Completion requests over prompt + response with vLLM's `prompt_logprobs`: the log-probability of
every prompt position's own token given the tokens before it, from the raw logits (temperature 1:
the teacher's own distribution, whatever the student samples at). Each request generates one
token, which is thrown away, so the server's context must hold the sequence plus one. The
teacher server is started from real weights and never receives any.

Cost (benchmarks/teacher_scoring.py: scoring a step now takes about the time of generating it):
a step's sequences go in a few requests, each a list of up to `request_tokens` tokens' worth of
sequences (vLLM's batched `prompt`), not one request per sequence (per request the server pays
HTTP, scheduling and response building); identical sequences (a group's samples often repeat each
other) are scored once; `prompt_logprobs: 0` asks for each position's own token only. A server
started here on CPU gets its share of the cores (cpu_thread_env) and an engine step that holds a
step's sequences (cpu_scheduling_args); its workers compute an engine step's prompt logprobs at
once (rollout/worker/prompt_logprobs.py).
"""

from __future__ import annotations

import math
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megatron_rl.rollout.engines.http import JsonClient
from megatron_rl.rollout.engines.vllm_server import VllmServerEngine, VllmServerProcess
from megatron_rl.rollout.protocol import EngineError, EngineUnavailable

# Tokens of sequences per request: one request for a tiny run's step, a few concurrent ones for a
# large step (each answer carries about 90 bytes of JSON per token).
REQUEST_TOKENS = 16384


class TeacherServer:
    def __init__(self, url: str, *, name: str = "teacher", process: VllmServerProcess | None = None,
                 request_timeout_s: float = 600.0, max_retries: int = 2, max_concurrency: int = 8,
                 request_tokens: int = REQUEST_TOKENS):
        self.name, self.url, self.process = name, url.rstrip("/"), process
        self.request_timeout_s, self.max_concurrency = request_timeout_s, max_concurrency
        self.request_tokens = request_tokens
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
        # No access-log line per request in the teacher's log: the trainer's requests are its only ones.
        process = VllmServerProcess.start(model_dir, port=port, log_path=log_path, name="teacher", dtype=dtype,
                                          max_model_len=max_model_len, seed=seed, cpu_kv_cache_gib=cpu_kv_cache_gib,
                                          gpu_memory_utilization=gpu_memory_utilization,
                                          startup_timeout_s=startup_timeout_s,
                                          extra_args=["--disable-uvicorn-access-log", *cpu_scheduling_args(),
                                                      *(extra_args or [])],
                                          extra_env=cpu_thread_env())
        try:
            return cls(process.url, process=process, request_timeout_s=request_timeout_s)
        except Exception:
            process.stop()
            raise

    def logprobs(self, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """For each (prompt ids, response ids): log pi_T(response[t] | prompt, response[:t]) for
        every response position. Raises EngineError naming the server (EngineUnavailable when the
        server we started has exited)."""
        distinct: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
        slots = [distinct.setdefault((tuple(prompt), tuple(response)), len(distinct)) for prompt, response in sequences]
        items = list(distinct)
        scored: list[list[float]] = [[] for _ in items]
        chunks = self._chunks([index for index, (_, response) in enumerate(items) if response], items)
        if chunks:
            with ThreadPoolExecutor(max_workers=min(len(chunks), self.max_concurrency)) as pool:
                futures = [pool.submit(self._score, [items[index] for index in chunk]) for chunk in chunks]
                try:
                    for chunk, future in zip(chunks, futures):
                        for index, row in zip(chunk, future.result()):
                            scored[index] = row
                except EngineError:
                    for future in futures:
                        future.cancel()
                    self._raise_if_dead()
                    raise
        return [list(scored[slot]) for slot in slots]

    def _chunks(self, indices: list[int], items) -> list[list[int]]:
        """`indices` in requests of at most request_tokens tokens each (a longer sequence alone)."""
        chunks, tokens = [], 0
        for index in indices:
            length = len(items[index][0]) + len(items[index][1])
            if not chunks or tokens + length > self.request_tokens:
                chunks.append([])
                tokens = 0
            chunks[-1].append(index)
            tokens += length
        return chunks

    def _score(self, items: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[list[float]]:
        """One request: a list of token prompts, one choice each (matched by its index)."""
        sequences = [[*prompt, *response] for prompt, response in items]
        body = {"model": self.model, "prompt": sequences, "max_tokens": 1, "temperature": 1.0, "seed": 0,
                # 0: only each position's own token (no alternatives), from the raw logits
                "prompt_logprobs": 0}
        try:
            reply = self._client.post("/v1/completions", body, timeout_s=self.request_timeout_s)
        except ValueError as exc:  # a body that is not JSON
            raise EngineError(f"{self.name}: POST /v1/completions answered something that is not JSON ({exc})") from None
        choices = reply.get("choices") if isinstance(reply, dict) else None
        if not isinstance(choices, list) or len(choices) != len(items):
            raise EngineError(f"{self.name}: POST /v1/completions answered {_described(choices, 'choices')} for "
                              f"{len(items)} sequences, not a completion per sequence: {str(reply)[:200]}")
        rows: list[list[float] | None] = [None] * len(items)
        for choice in choices:
            index = choice.get("index") if isinstance(choice, dict) else None
            if not isinstance(index, int) or not 0 <= index < len(items) or rows[index] is not None:
                raise EngineError(f"{self.name}: a completion choice with index {index!r} among {len(items)} sequences")
            rows[index] = self._row(choice.get("prompt_logprobs"), items[index], sequences[index])
        return rows

    def _row(self, entries, item, tokens: list[int]) -> list[float]:
        if not isinstance(entries, list) or len(entries) != len(tokens):
            raise EngineError(f"{self.name}: the server returned {_described(entries, 'prompt logprobs')} for "
                              f"{len(tokens)} tokens (a vLLM without prompt_logprobs?)")
        return [_token_logprob(self.name, entries[position], tokens[position])
                for position in range(len(item[0]), len(tokens))]

    def engine(self) -> VllmServerEngine:
        """The same server as a rollout engine that samples (the teacher's held-out evaluation)."""
        return VllmServerEngine(self.url, name=self.name, process=None, request_timeout_s=self.request_timeout_s)

    def _raise_if_dead(self) -> None:
        if self.process is not None and not self.process.alive():
            code = self.process.process.returncode
            raise EngineUnavailable(f"{self.name}: server process exited with code {code}{_killed_by(code)}; its log: "
                                    f"{self.process.log_path}\nlast lines:\n{self.process.log_tail()}")

    def shutdown(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None


def cpu_thread_env(environ=None) -> dict[str, str]:
    """The teacher server's OpenMP threads on a CPU node: its share of the cores beside the
    trainer's ranks on this node (LOCAL_WORLD_SIZE), at least 1, unless OMP_NUM_THREADS is set.
    With one OpenMP thread per core the server's threads spin at every barrier while a trainer's
    process holds one of those cores: on 2 cores the same scoring request took 0.87 s with 2
    threads, 0.14 s with 1 (benchmarks/results/teacher_scoring_cpu.md); with other processes busy
    on the cores, 0.5-12 s against 0.12-0.6 s."""
    import torch

    environ = os.environ if environ is None else environ
    if torch.cuda.is_available() or "OMP_NUM_THREADS" in environ:
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ranks = int(environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return {"OMP_NUM_THREADS": str(max(1, cores // (ranks + 1)))}


def cpu_scheduling_args() -> list[str]:
    """On CPU, a step's sequences in one engine step: the budgets vLLM gives its CPU engine in a
    process (a colocated rollout engine's) rather than its CPU server's (128 sequences, 2048 tokens),
    which cut one scoring into several steps."""
    import torch

    return [] if torch.cuda.is_available() else ["--max-num-seqs", "256", "--max-num-batched-tokens", "4096"]


def _killed_by(code: int | None) -> str:
    try:
        return f" (killed by {signal.Signals(-code).name})" if code is not None and code < 0 else ""
    except ValueError:
        return ""


def _described(value, what: str) -> str:
    return f"{len(value)} {what}" if isinstance(value, list) else f"no {what} ({type(value).__name__})"


def _token_logprob(name: str, entry, token: int) -> float:
    """The logprob of `token` in one prompt_logprobs entry ({token id: {"logprob": ...}}, ids as
    JSON strings)."""
    value = entry.get(str(token)) if isinstance(entry, dict) else None
    if value is None:
        raise EngineError(f"{name}: prompt_logprobs holds no value for token {token}")
    try:
        value = float(value["logprob"] if isinstance(value, dict) else value)
    except (KeyError, TypeError, ValueError):
        raise EngineError(f"{name}: prompt_logprobs holds {str(value)[:80]!r} for token {token}, not a number") from None
    if math.isnan(value):
        raise EngineError(f"{name}: the teacher's logprob of token {token} is NaN")
    return value
