"""SGLang as an HTTP server (`python -m sglang.launch_server`), on this node or another.

    server = SglangServerProcess.start(model_dir, port=30000, log_path=run_dir / "sglang-0.log")
    engine = SglangServerEngine(server.url, name="sglang-0", process=server, staging_dir=shared_dir)

UNTESTED AGAINST A LIVE SGLANG SERVER. SGLang cannot be installed on the development machines or
in CI (it pins a CUDA build of torch, and its kernel package ships GPU kernels only). What is
tested is this module against a fake server that speaks the same HTTP API
(tests/rollout/test_sglang_mock_http.py); the endpoint names and payloads follow SGLang's
documentation and source. Run a real server on a GPU and compare its logprobs with the trainer's
before relying on this engine.

Generation uses the native `/generate` endpoint with token ids in and token ids, per-token
logprobs and finish reasons out. The n samples of a prompt are sent as n entries of one batch
request, each with its own `sampling_seed`: SGLang serves `n > 1` by copying the request together
with its sampling parameters, so under `--enable-deterministic-inference` (the only mode in which
SGLang honours `sampling_seed`) all n copies would share one seed and come back identical.

Weights arrive as files, the one transport a run configures for SGLang (`rollout.weight_transport:
files`, the default for it): the trainer's files transport (rollout/weights/transport.py) writes
each push once as an HF-style safetensors directory on a filesystem the trainer and the servers
share, and every server reloads it in place (`/update_weights_from_disk`, `load_weight_files`);
`update_weights` does the same for one engine by hand. The engine has no CollectiveWeights
(protocol.py), and the config check refuses the collective transports for SGLang: their receiving
side is our vLLM worker extension, and SGLang's workers run none of our code. Afterwards the radix (prefix) cache is flushed, so no request
reuses KV computed with the old weights.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any, Literal

import torch

from megatron_rl.rollout.engines.http import JsonClient
from megatron_rl.rollout.protocol import (
    EngineError,
    Sample,
    SamplingParams,
    WeightStream,
)
from megatron_rl.rollout.engines.server_process import ServerEngineBase, ServerProcess

# SGLang returns log softmax(logits / temperature) for a sampled token (before its top-p / top-k
# filter, which training refuses: config/rl.py) unless its server runs with this variable set.
RETURN_ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
# Top logprobs of one next token that SglangServerEngine.check_sampling_logprobs compares.
_PROBE_TOP = 8
# Files the push copies next to the weights, so the staging directory is a complete HF
# checkpoint for any loader that reads the model config from `model_path`.
_HF_CONFIG_FILES = ("config.json", "generation_config.json")


class SglangServerProcess(ServerProcess):
    """An SGLang server we started; owns the process and its log file (only the command line is
    SGLang's; readiness, log tail and process-group teardown are shared)."""

    @classmethod
    def start(
        cls, model_dir: str | Path, *, port: int, log_path: str | Path, name: str = "sglang-server",
        host: str = "127.0.0.1", dtype: str = "auto", tp_size: int = 1, mem_fraction_static: float | None = None,
        context_length: int | None = None, seed: int = 0, deterministic: bool = False,
        return_routed_experts: bool = False, startup_timeout_s: float = 900.0, extra_args: list[str] | None = None,
    ) -> SglangServerProcess:
        env = dict(os.environ)
        # Without this, /health runs a one-token generation that queues behind a paused scheduler
        # and reports a paused (healthy) engine as dead. A crash is still caught: the process
        # exits, and generate() raises.
        env.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
        # Logprobs of the distribution SGLang samples from (after temperature), which the trainer
        # trains on; set, this variable makes them softmax(logits)'s whatever the temperature.
        env[RETURN_ORIGINAL_LOGPROB_ENV] = "false"
        command = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", str(model_dir), "--host", host, "--port", str(port),
            "--dtype", dtype, "--tp-size", str(tp_size), "--random-seed", str(seed),
        ]
        if mem_fraction_static is not None:
            command += ["--mem-fraction-static", str(mem_fraction_static)]
        if context_length is not None:
            command += ["--context-length", str(context_length)]
        if deterministic:
            command.append("--enable-deterministic-inference")
        if return_routed_experts:
            command.append("--enable-return-routed-experts")
        command += extra_args or []
        return cls.launch(command, env=env, url=f"http://{host}:{port}", log_path=log_path, name=name,
                          startup_timeout_s=startup_timeout_s, served_model=str(model_dir))


class SglangServerEngine(ServerEngineBase):
    health_timeout_s = 30.0

    def __init__(
        self, url: str, *, name: str = "sglang-server", process: ServerProcess | None = None,
        staging_dir: str | Path | None = None, hf_config_dir: str | Path | None = None,
        disk_load_format: str | None = None, return_routed_experts: bool = False,
        pause_mode: Literal["abort", "retract"] = "abort", request_timeout_s: float = 900.0,
        max_retries: int = 2, max_concurrency: int = 64,
    ):
        self.name, self.url, self.process = name, url.rstrip("/"), process
        self.staging_dir = Path(staging_dir) if staging_dir else None
        self.hf_config_dir = Path(hf_config_dir) if hf_config_dir else None
        self.disk_load_format = disk_load_format
        self.return_routed_experts, self.pause_mode = return_routed_experts, pause_mode
        self.request_timeout_s, self.max_concurrency = request_timeout_s, max_concurrency
        self._client = JsonClient(name, url, timeout_s=request_timeout_s, max_retries=max_retries)
        self._pushes = 0
        self._closed = False
        self.health()
        info = self._client.get("/get_server_info", timeout_s=30)
        self.deterministic = bool(info.get("enable_deterministic_inference", False))

    # ---- generation ---------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, timeout_s: float | None = None
    ) -> list[list[Sample]]:
        timeout = timeout_s or self.request_timeout_s
        if not prompts:
            return []
        if self.deterministic and params.seed is None and params.n > 1 and params.temperature > 0:
            # SGLang's deterministic sampler falls back to one fixed seed for every request without
            # one, so the group would be n copies of one sample and every advantage zero.
            raise EngineError(f"{self.name}: the server runs deterministic inference; pass SamplingParams.seed "
                              f"or the {params.n} samples of each prompt come back identical")
        # One request per prompt: each sample carries its own seed, so results do not depend on
        # batching or on how prompts are split across engines.
        return self._per_prompt(self._generate_group, prompts, params, timeout)

    def _generate_group(self, index: int, prompt: list[int], params: SamplingParams, timeout: float) -> list[Sample]:
        prompt_params = params.for_prompt(index)  # its seed is the prompt's; sample j derives from it
        request_id = uuid.uuid4().hex[:12]
        rids = [f"{self.name}-{request_id}-{index}-{position}" for position in range(params.n)]
        body: dict[str, Any] = {
            "input_ids": [list(prompt) for _ in range(params.n)],
            "sampling_params": [
                self._sampling(prompt_params, prompt_params.prompt_seed(position)) for position in range(params.n)
            ],
            "rid": rids,
            "return_logprob": True,
            "logprob_start_len": -1,  # logprobs of the output tokens only
            "stream": False,
        }
        if self.return_routed_experts:
            body["return_routed_experts"] = True
        response = self._client.post("/generate", body, timeout_s=timeout)
        outputs = response if isinstance(response, list) else [response]
        return [
            self._sample(index, position, prompt, output)
            for position, output in enumerate(self._in_request_order(rids, outputs))
        ]

    def check_sampling_logprobs(self, temperature: float) -> None:
        """Refuse a server whose logprobs ignore the sampling temperature (one started with
        SGLANG_RETURN_ORIGINAL_LOGPROB set). No endpoint reports that setting, so it is measured:
        the top logprobs of one next token at `temperature` and at 1. After temperature the spread
        between the most and the least likely of them is the spread at 1 divided by `temperature`;
        without, it is unchanged."""
        at_one, at_temperature = self._top_logprob_spread(1.0), self._top_logprob_spread(temperature)
        if not at_one > 1e-5:
            raise EngineError(f"{self.name}: cannot tell whether the server's logprobs follow the temperature: "
                              f"its top {_PROBE_TOP} next-token logprobs are all equal ({at_one:.3g} apart)")
        if abs(at_temperature - at_one / temperature) > abs(at_temperature - at_one):
            raise EngineError(
                f"{self.name}: the server returns logprobs before temperature (their spread is {at_temperature:.4g} "
                f"at temperature {temperature} and {at_one:.4g} at 1), so the trainer's logprobs of the sampling "
                f"distribution (rl.temperature) would not match them; restart it without "
                f"{RETURN_ORIGINAL_LOGPROB_ENV}")

    def _top_logprob_spread(self, temperature: float) -> float:
        """max - min of the top next-token logprobs after a one-token prompt, at `temperature`."""
        body = {"input_ids": [[0]], "sampling_params": [{"temperature": temperature, "max_new_tokens": 1, "n": 1}],
                "return_logprob": True, "top_logprobs_num": _PROBE_TOP, "logprob_start_len": -1, "stream": False}
        response = self._client.post("/generate", body)
        output = response[0] if isinstance(response, list) else response
        top = ((output.get("meta_info") or {}).get("output_top_logprobs") or [None])[0]
        if not top:
            raise EngineError(f"{self.name}: /generate returned no output_top_logprobs (top_logprobs_num ignored?)")
        values = [float(entry[0]) for entry in top]
        return max(values) - min(values)

    @staticmethod
    def _sampling(params: SamplingParams, seed: int | None) -> dict[str, Any]:
        sampling: dict[str, Any] = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_new_tokens": params.max_tokens,
            "n": 1,  # the group is spread over batch entries, see the module docstring
        }
        if params.stop:
            sampling["stop"] = list(params.stop)
        if params.stop_token_ids:
            sampling["stop_token_ids"] = list(params.stop_token_ids)
        if params.ignore_eos:
            sampling["ignore_eos"] = True
        if seed is not None:
            sampling["sampling_seed"] = seed
        return sampling

    def _in_request_order(self, rids: list[str], outputs: list[dict]) -> list[dict]:
        """Batch outputs come back in input order; match them by request id where the server echoes
        it (meta_info.id), so a reordering could never pair a sample with another's seed."""
        if len(outputs) != len(rids):
            raise EngineError(f"{self.name}: /generate returned {len(outputs)} outputs for {len(rids)} requests")
        by_id = {(output.get("meta_info") or {}).get("id"): output for output in outputs}
        if all(rid in by_id for rid in rids):
            return [by_id[rid] for rid in rids]
        return outputs

    def _sample(self, index: int, position: int, prompt: list[int], output: dict) -> Sample:
        meta = output.get("meta_info") or {}
        reason = _finish_reason(self.name, meta.get("finish_reason"))
        entries = meta.get("output_token_logprobs")
        if entries is None:
            raise EngineError(f"{self.name}: /generate returned no output_token_logprobs (return_logprob ignored?)")
        # Each entry is [logprob, token_id, token_text or None].
        logprob_tokens = [int(entry[1]) for entry in entries]
        if any(entry[0] is None for entry in entries):
            raise EngineError(f"{self.name}: /generate returned a null logprob for an output token")
        logprobs = [float(entry[0]) for entry in entries]
        token_ids = [int(token) for token in output["output_ids"]] if "output_ids" in output else logprob_tokens
        if token_ids != logprob_tokens:
            raise EngineError(f"{self.name}: output_ids and output_token_logprobs disagree for prompt {index}, "
                              f"sample {position}")
        extras: dict[str, Any] = {}
        if meta.get("routed_experts") is not None:
            extras["routed_experts"] = self._routed_experts(meta["routed_experts"], len(prompt) + len(token_ids) - 1)
        if meta.get("weight_version") is not None:
            extras["weight_version"] = meta["weight_version"]
        return Sample(index, position, list(prompt), token_ids, logprobs, reason, extras)

    def _routed_experts(self, encoded: str | list, positions: int) -> torch.Tensor:
        """[positions, layers * top_k] int32: the experts chosen for every token the model read.

        SGLang returns base64 of a flat int32 array with logical shape [tokens, layers, top_k]
        over the sequence except its last token (which no forward pass read)."""
        if isinstance(encoded, str):
            flat = torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.int32)
        else:
            flat = torch.tensor(encoded, dtype=torch.int32).flatten()
        if positions <= 0 or flat.numel() % positions:
            raise EngineError(f"{self.name}: routed_experts has {flat.numel()} entries, "
                              f"not a multiple of {positions} positions")
        return flat.reshape(positions, -1)

    # ---- weights ------------------------------------------------------------------------------

    def update_weights(self, weights: WeightStream, *, bucket_bytes: int = 512 << 20) -> int:
        """A whole push through files in `staging_dir` (the files transport for one engine)."""
        from megatron_rl.rollout.weights.transport import write_safetensors_dir

        if self.staging_dir is None:
            raise EngineError(f"{self.name}: no staging_dir (a directory the server can read) for the weight files")
        self._pushes += 1
        push_dir = self.staging_dir / f"{self.name}-push-{self._pushes:06d}"
        try:
            if write_safetensors_dir(weights, push_dir, bucket_bytes) == 0:
                raise EngineError(f"{self.name}: weight update received no tensors")
            return self.load_weight_files(str(push_dir))
        finally:
            shutil.rmtree(push_dir, ignore_errors=True)

    def load_weight_files(self, directory: str) -> int:
        """The files transport: SGLang reloads the HF-style directory in place, then the cache is flushed."""
        push_dir = Path(directory)
        weight_map = json.loads((push_dir / "model.safetensors.index.json").read_text())["weight_map"]
        for file_name in _HF_CONFIG_FILES:
            if self.hf_config_dir is not None and (self.hf_config_dir / file_name).exists():
                shutil.copy(self.hf_config_dir / file_name, push_dir / file_name)
        body: dict[str, Any] = {"model_path": str(push_dir), "flush_cache": True, "weight_version": str(self._pushes)}
        if self.disk_load_format is not None:
            body["load_format"] = self.disk_load_format
        self._check_success("/update_weights_from_disk", self._client.post("/update_weights_from_disk", body))
        self._flush_cache()
        return len(weight_map)

    def reset_prefix_cache(self) -> None:
        self._flush_cache()

    # No CollectiveWeights: the collective transports' receiving side is our vLLM worker extension
    # (rollout/worker/receiver.py), and SGLang's workers run none of our code. The config check
    # refuses them for SGLang by name (config/rollout.py; factory.check_engine_capabilities).

    def _check_success(self, path: str, result: Any) -> None:
        # Failures usually arrive as HTTP 400 (an EngineError from the client); a 200 with
        # success=false would be a server inconsistency, but it must not pass silently.
        if not isinstance(result, dict) or not result.get("success", False):
            message = result.get("message") if isinstance(result, dict) else result
            raise EngineError(f"{self.name}: {path} failed: {message}")

    def _flush_cache(self) -> None:
        """Explicit even where the update request asked for a flush: older servers ignore that
        field, and a refused flush (requests still queued) must surface rather than pass."""
        try:
            self._client.post("/flush_cache")
        except ValueError:
            # Success: SGLang answers 200 with a plain-text body ("Cache flushed. ..."), which the
            # JSON client cannot parse. A refusal is HTTP 400 and raises EngineError.
            pass
        except EngineError as exc:
            raise EngineError(f"{self.name}: prefix cache not flushed after a weight update "
                              f"(requests still running or waiting?): {exc}") from exc

    # ---- lifecycle ----------------------------------------------------------------------------

    def fingerprint(self) -> None:
        """SGLang runs none of our code in its workers, so nothing digests what a push delivered:
        its pushes are not verified (rollout/weights/digest.py)."""
        return None

    def pause(self) -> None:
        # SGLang has no "let in-flight requests finish" mode. "abort" returns them as aborted, so a
        # generate() racing the pause fails loudly instead of finishing with mixed weights
        # ("retract" resumes them after the weight update).
        self._client.post("/pause_generation", {"mode": self.pause_mode})

    def resume(self) -> None:
        self._client.post("/continue_generation", {})

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.process is not None:
            self.process.stop()


def _finish_reason(engine: str, reason: Any) -> str:
    """meta_info.finish_reason is {"type": "stop" | "length" | "abort", ...} (None while running)."""
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind in ("stop", "length"):
        return kind
    detail = reason.get("message") if isinstance(reason, dict) else None
    raise EngineError(f"{engine}: request ended with finish reason {kind!r}" + (f": {detail}" if detail else ""))


