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

Weight transports (`weight_transport=`):
- "disk" (any setup where trainer and server share a filesystem): the stream is written as an
  HF-style safetensors checkpoint into `staging_dir`, the server reloads it in place
  (`/update_weights_from_disk`), and the files are deleted afterwards.
- "distributed" (GPU): trainer rank 0 joins the server's workers in a torch.distributed group
  (`/init_weights_update_group`) and broadcasts every tensor while the server receives it
  (`/update_weights_from_distributed`). Works with "gloo" too, which is how the test checks the
  protocol on CPU.
- "tensor" (GPU, same node only): CUDA IPC handles of the tensors travel in the request
  (`/update_weights_from_tensor`); the server maps the trainer's GPU memory, so it cannot work
  across nodes or with CPU tensors.
After any of them the radix (prefix) cache is flushed, so no request reuses KV computed with the
old weights.
"""

from __future__ import annotations

import base64
import datetime
import io
import json
import os
import shutil
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import torch

from megatron_rl.bridge.export import buckets
from megatron_rl.rollout.engines.http import JsonClient
from megatron_rl.rollout.protocol import (
    EngineError,
    Sample,
    SamplingParams,
    WeightStream,
)
from megatron_rl.rollout.engines.server_process import ServerEngineBase, ServerProcess

WeightTransport = Literal["disk", "distributed", "tensor"]
# SGLang returns log softmax(logits / temperature) for a sampled token (before its top-p / top-k
# filter, which training refuses: config/rl.py) unless its server runs with this variable set.
RETURN_ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
# Top logprobs of one next token that SglangServerEngine.check_sampling_logprobs compares.
_PROBE_TOP = 8
# Files the disk transport copies next to the weights, so the staging directory is a complete HF
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
                          startup_timeout_s=startup_timeout_s)


class SglangServerEngine(ServerEngineBase):
    health_timeout_s = 30.0

    def __init__(
        self, url: str, *, name: str = "sglang-server", process: ServerProcess | None = None,
        weight_transport: WeightTransport = "disk", staging_dir: str | Path | None = None,
        hf_config_dir: str | Path | None = None, disk_load_format: str | None = None,
        master_address: str | None = None, master_port: int | None = None, group_backend: str = "nccl",
        engine_world_size: int | None = None, return_routed_experts: bool = False,
        pause_mode: Literal["abort", "retract"] = "abort", request_timeout_s: float = 900.0,
        max_retries: int = 2, max_concurrency: int = 64,
    ):
        self.name, self.url, self.process = name, url.rstrip("/"), process
        self.weight_transport = weight_transport
        self.staging_dir = Path(staging_dir) if staging_dir else None
        self.hf_config_dir = Path(hf_config_dir) if hf_config_dir else None
        self.disk_load_format = disk_load_format
        self.master_address, self.master_port, self.group_backend = master_address, master_port, group_backend
        self.return_routed_experts, self.pause_mode = return_routed_experts, pause_mode
        self.request_timeout_s, self.max_concurrency = request_timeout_s, max_concurrency
        self._client = JsonClient(name, url, timeout_s=request_timeout_s, max_retries=max_retries)
        self._pushes = 0
        self._group = None  # the torch.distributed group of the "distributed" transport, made on first push
        self._group_name = f"{name}-weights"
        self._closed = False
        if weight_transport == "disk" and self.staging_dir is None:
            raise EngineError(f"{name}: the disk weight transport needs a staging_dir shared with the server")
        if weight_transport == "distributed" and (master_address is None or master_port is None):
            raise EngineError(f"{name}: the distributed weight transport needs master_address and master_port")
        self.health()
        info = self._client.get("/get_server_info", timeout_s=30)
        self.tp_size = int(info.get("tp_size") or 1)
        self.deterministic = bool(info.get("enable_deterministic_inference", False))
        # Each server worker joins the weight group as rank_offset + its TP rank; pipeline stages
        # and data-parallel replicas inside one server are not covered (untested), so callers
        # with such servers pass the count themselves.
        self.engine_world_size = engine_world_size or self.tp_size

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
        self._pushes += 1
        if self.weight_transport == "disk":
            count = self._push_disk(weights, bucket_bytes)
        elif self.weight_transport == "distributed":
            count = self._push_distributed(weights, bucket_bytes)
        elif self.weight_transport == "tensor":
            count = self._push_tensor(weights, bucket_bytes)
        else:
            raise EngineError(f"{self.name}: unknown weight transport {self.weight_transport!r}")
        if count == 0:
            raise EngineError(f"{self.name}: weight update received no tensors")
        return count

    def _push_disk(self, weights: WeightStream, bucket_bytes: int) -> int:
        from megatron_rl.rollout.weights.transport import write_safetensors_dir

        push_dir = self.staging_dir / f"{self.name}-push-{self._pushes:06d}"
        try:
            if write_safetensors_dir(weights, push_dir, bucket_bytes) == 0:
                return 0
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

    # The trainer's collective transport builds its groups on its own store (rollout/weights/group.py);
    # SGLang's workers build theirs with SGLang's rendezvous, which is reachable through this
    # engine's own `weight_transport="distributed"` only (untested live, see the module docstring).
    def weight_receivers(self) -> int:
        raise EngineError(f"{self.name}: SGLang servers take the trainer's weights through files "
                          f"(rollout.weight_transport=files)")

    def join_weight_group(self, spec_json: str, rank_offset: int) -> None:
        self.weight_receivers()

    def receive_weights(self) -> int:
        return self.weight_receivers()

    def _push_distributed(self, weights: WeightStream, bucket_bytes: int) -> int:
        """GPU path (untested live): rank 0 broadcasts each bucket while the server receives it."""
        import torch.distributed as dist

        if self._group is None:
            self._group = self._join_weight_group()
        nccl = self.group_backend == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        count = 0
        for bucket in buckets(weights, bucket_bytes):
            tensors = [tensor.detach().to(device).contiguous() for _, tensor in bucket]
            body = {
                "names": [name for name, _ in bucket],
                "dtypes": [str(tensor.dtype).removeprefix("torch.") for tensor in tensors],
                "shapes": [list(tensor.shape) for tensor in tensors],
                "group_name": self._group_name,
                "flush_cache": False,  # once, after the last bucket
            }
            # The request returns only after the server received every tensor, so it runs on its
            # own thread while this one broadcasts them in the same order. (src is a group rank
            # too: the group maps its ranks onto themselves, see init_weight_update_group.)
            with ThreadPoolExecutor(max_workers=1) as pool:
                reply = pool.submit(self._client.post, "/update_weights_from_distributed", body)
                for tensor in tensors:
                    dist.broadcast(tensor, src=0, group=self._group)
                self._check_success("/update_weights_from_distributed", reply.result())
            count += len(tensors)
        self._flush_cache()
        return count

    def _join_weight_group(self):
        world_size = 1 + self.engine_world_size
        body = {
            "master_address": self.master_address, "master_port": int(self.master_port),
            "rank_offset": 1, "world_size": world_size, "group_name": self._group_name, "backend": self.group_backend,
        }
        # Both sides block in the rendezvous until everyone arrived: the request runs on its own
        # thread while this one joins as rank 0 (which hosts the rendezvous store).
        with ThreadPoolExecutor(max_workers=1) as pool:
            reply = pool.submit(self._client.post, "/init_weights_update_group", body)
            try:
                group = init_weight_update_group(
                    self.master_address, int(self.master_port), rank=0, world_size=world_size,
                    group_name=self._group_name, backend=self.group_backend,
                    timeout=datetime.timedelta(seconds=self.request_timeout_s),
                )
            except Exception as exc:
                # The server's answer usually says why nobody joined (bad address, port taken).
                answer = reply.exception() or reply.result()
                raise EngineError(f"{self.name}: joining the weight group at {self.master_address}:"
                                  f"{self.master_port} failed: {exc}; server said: {answer}") from exc
            self._check_success("/init_weights_update_group", reply.result())
        return group

    def _push_tensor(self, weights: WeightStream, bucket_bytes: int) -> int:
        """Same-node GPU path (untested live): CUDA IPC handles, not bytes, travel in the request."""
        from multiprocessing.reduction import ForkingPickler

        count = 0
        for bucket in buckets(weights, bucket_bytes):
            tensors = [(name, tensor.detach().contiguous()) for name, tensor in bucket]
            if any(not tensor.is_cuda for _, tensor in tensors):
                raise EngineError(f"{self.name}: the tensor weight transport needs CUDA tensors on the server's node; "
                                  f"use the disk or distributed transport")
            # The format of SGLang's MultiprocessingSerializer: a ForkingPickler dump of the list
            # of (name, tensor), base64 for JSON, one copy per TP rank. The tensors stay referenced
            # until the request returns, which is after the server copied them.
            buffer = io.BytesIO()
            ForkingPickler(buffer).dump(tensors)
            payload = base64.b64encode(buffer.getvalue()).decode()
            body = {"serialized_named_tensors": [payload] * self.tp_size, "flush_cache": False}
            self._check_success("/update_weights_from_tensor", self._client.post("/update_weights_from_tensor", body))
            count += len(tensors)
        self._flush_cache()
        return count

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
        if self._group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(self._group)
            self._group = None
        if self.process is not None:
            self.process.stop()


def init_weight_update_group(master_address: str, master_port: int, *, rank: int, world_size: int, group_name: str,
                             backend: str, timeout: datetime.timedelta):
    """A torch.distributed group beside the trainer's own, built the way SGLang's workers build theirs
    (`init_custom_process_group`: a TCP rendezvous, a store prefixed with the group name, a process
    group registered under that name) so both sides find each other's keys. Rank 0 hosts the store.

    `torch.distributed.new_group` cannot do this: it only splits the already-initialized world,
    and the server's workers are not part of the trainer's world."""
    import inspect

    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    init_method = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    # torch renamed pg_options to backend_options; pass whichever this version takes.
    parameters = inspect.signature(_new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in parameters else "pg_options"
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                         timeout=timeout, **{options: None})
    _world.pg_group_ranks[group] = {index: index for index in range(world_size)}
    return group


def _finish_reason(engine: str, reason: Any) -> str:
    """meta_info.finish_reason is {"type": "stop" | "length" | "abort", ...} (None while running)."""
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind in ("stop", "length"):
        return kind
    detail = reason.get("message") if isinstance(reason, dict) else None
    raise EngineError(f"{engine}: request ended with finish reason {kind!r}" + (f": {detail}" if detail else ""))


