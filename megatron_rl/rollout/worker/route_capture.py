"""The rollout engine's own MoE routes, per generated sample (R3, `rl.routing_replay: rollout`).

R3 replays in the trainer the experts the engine chose for every token it ran, so the trainer
computes the network the engine sampled from. vLLM's GPU build returns them itself
(`--enable-return-routed-experts`, a `routed_experts` field per completion); its CPU build cannot
(that path needs the V2 model runner, which needs Triton). This module captures them inside the
engine's workers instead, from the engine's own forward:

- every MoE layer's router (vLLM's `BaseRouter`, the one place its top-k is chosen) gets vLLM's
  own capture callback (`set_capture_fn`, the hook vLLM's GPU capturer uses), which receives the
  logical (HF-numbered) expert ids of every token of the forward, before any expert-parallel
  remapping;
- the model runner's forward (`_model_forward`) is wrapped: after each forward, the tokens of the
  step are attributed to requests by the runner's own batch layout (`input_batch.req_ids`,
  `query_start_loc`) and the forward's `positions`, and their routes are stored per KV-cache slot
  (block id, offset), next to the token id, for every request, tagged or not;
- a request asks for its routes through its sampling parameters' `extra_args[ROUTE_CAPTURE_KEY]`
  (a tag; the n samples of one prompt share it). When it leaves the batch, its routes are read
  from the slots of its block table: position p of the request gets the route computed with the
  KV now in the slot it attends to. So a prompt prefix served from vLLM's prefix cache (the n>1
  samples of a prompt share its blocks; a shared system prompt across prompts) gets the routes of
  the forward that computed that KV, a preempted and recomputed request the routes of its
  recomputation, exactly as the engine ran them. The stored token ids let the client check every
  position against the sample's tokens.

Capture starts with the first `route_capture_enable` call (the engine client resets the prefix
cache then, so no cached block predates the capture), and costs one [tokens, layers, k] copy per
forward. The routes of a sample are an int16 tensor [prompt + response - 1, MoE layers, k]: every
token the engine ran a forward on (the last response token is never fed back), MoE layers in
model order.

`RouteCaptureWorker` is mixed into our vLLM worker extension (rollout/worker/extension.py); the
functions below it are the client side, used by the vLLM engines' `generate`.
"""

from __future__ import annotations

import base64
import json
import uuid
from dataclasses import dataclass, field

import numpy as np
import torch

from megatron_rl.rollout.protocol import EngineError, Sample

ROUTE_CAPTURE_KEY = "megatron_rl_route_capture"  # in vLLM SamplingParams.extra_args: the request's tag
_MAX_UNCLAIMED = 65536  # finished requests kept for a later take; the oldest go first beyond this


# ---------------------------------------------------------------------------------------------
# Engine side: inside vLLM's worker (collective_rpc methods).
# ---------------------------------------------------------------------------------------------


def vllm_returns_routes(vllm_config) -> bool:
    """Whether vLLM captures every request's routed experts itself (enable_return_routed_experts).
    The flag moved: vLLM 0.32 keeps it in `aux_output_config` (vllm/config/aux_output.py), 0.26 (the
    last release pinning torch 2.11) in `model_config` (vllm/config/model.py); reading only the first,
    a 0.26 engine returning its routes got our eager-only capture installed as well, and refused."""
    return any(getattr(getattr(vllm_config, section, None), "enable_return_routed_experts", False)
               for section in ("aux_output_config", "model_config"))


class RouteCaptureWorker:
    """Mixin for the vLLM worker extension: capture the MoE routes of tagged requests."""

    model_runner = None  # provided by the vLLM worker this class is mixed into

    def route_capture_enable(self) -> dict:
        """Install the capture (idempotent). Returns {"native": bool, "layers": [layer ids], "top_k": k}:
        `native` when vLLM captures routes itself (enable_return_routed_experts), in which case
        nothing is installed and the completions carry them; `layers` are the engine's MoE layers
        (transformer layer indices, ascending): the order of the routes' second dimension, and the
        rows to keep from vLLM's own all-layer array."""
        state = getattr(self, "_route_capture", None)
        if state is None:
            runner = self.model_runner
            layers, routers = _moe_routers(runner.get_model())
            if vllm_returns_routes(runner.vllm_config):
                return {"native": True, "layers": layers, "top_k": routers[0].top_k}
            state = self._route_capture = _Capture.install(runner, layers, routers)
        return {"native": False, "layers": state.layers, "top_k": state.top_k}

    def route_capture_take(self, tags_json: str) -> dict:
        """{tag: [{"request_id", "tokens", "routes", "shape"}, ...]} for the finished requests of
        each tag (JSON-safe: arrays as base64 of little-endian int32 tokens and int16 routes);
        they are dropped from the worker. `tags_json`: a JSON list (HTTP collective_rpc passes
        strings)."""
        state = getattr(self, "_route_capture", None)
        if state is None:
            raise RuntimeError("route_capture_take before route_capture_enable")
        return state.take(json.loads(tags_json))


@dataclass
class _Request:
    tag: str
    blocks: list[int]
    length: int = 0  # positions 0..length-1 have been computed (or served from the prefix cache)


@dataclass
class _Capture:
    runner: object
    layers: list[int]
    top_k: int
    dtype: torch.dtype
    block_size: int
    slot_routes: torch.Tensor  # [num_blocks * block_size, layers, k]; -1: no route (computed before capture)
    slot_tokens: torch.Tensor  # [num_blocks * block_size] token id whose KV is in the slot; -1: none
    step: list = field(default_factory=list)  # this forward's top-k ids, per MoE layer
    active: dict[str, _Request] = field(default_factory=dict)  # tagged requests in the engine
    finished: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)
    unclaimed: int = 0  # finished requests held for a take
    problem: str | None = None  # why some forward left its tokens without routes

    @classmethod
    def install(cls, runner, layers: list[int], routers: list) -> _Capture:
        config = runner.vllm_config
        if not config.model_config.enforce_eager:
            # A Python callback inside a captured CUDA graph (or a compiled graph) would not run.
            raise RuntimeError("route capture needs an eager engine (enforce_eager); on GPU start vLLM with "
                               "enable_return_routed_experts instead")
        if getattr(runner, "uses_mrope", False) or getattr(runner, "enable_prompt_embeds", False):
            raise RuntimeError("route capture needs plain token ids and 1-D positions "
                               "(no M-RoPE, no prompt embeddings)")
        groups = runner.kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise RuntimeError(f"route capture supports models with one KV-cache group, this one has {len(groups)}")
        top_k = routers[0].top_k
        experts = routers[0].global_num_experts
        block_size = groups[0].kv_cache_spec.block_size
        slots = runner.kv_cache_config.num_blocks * block_size
        device = runner.device
        dtype = torch.int16 if experts <= torch.iinfo(torch.int16).max else torch.int32
        state = cls(runner, layers, top_k, dtype, block_size,
                    torch.full((slots, len(layers), top_k), -1, dtype=dtype, device=device),
                    torch.full((slots,), -1, dtype=torch.int32, device=device))
        state.step = [None] * len(layers)
        for ordinal, router in enumerate(routers):
            router.set_capture_fn(state._capture_fn(ordinal))
        forward = runner._model_forward

        def model_forward(*args, **kwargs):
            state.begin_step()
            output = forward(*args, **kwargs)
            state.end_step(kwargs.get("input_ids"), kwargs.get("positions"))
            return output

        runner._model_forward = model_forward
        return state

    def _capture_fn(self, ordinal: int):
        def capture(topk_ids: torch.Tensor) -> None:
            self.step[ordinal] = topk_ids

        return capture

    # ---- around each forward ----------------------------------------------------------------

    def begin_step(self) -> None:
        """Before the forward (the runner has updated its batch): requests that left the engine
        are read out now, while their blocks still hold what they attended to."""
        self.step = [None] * len(self.layers)
        gone = [request_id for request_id in self.active if request_id not in self.runner.requests]
        for request_id in gone:
            self._finish(request_id)

    def end_step(self, input_ids: torch.Tensor | None, positions: torch.Tensor | None) -> None:
        runner = self.runner
        batch = runner.input_batch
        count = batch.num_reqs
        if count == 0:
            return
        request_ids = batch.req_ids[:count]
        starts = runner.query_start_loc.np[: count + 1]
        tokens = int(starts[-1])
        if any(ids is None or ids.shape[0] < tokens for ids in self.step) or input_ids is None:
            # Never expected (every forward of the runner routes all its tokens in every MoE
            # layer): the step's slots get no routes, so a sample reading them fails loudly.
            self.problem = (f"a forward of {tokens} tokens without routes from every MoE layer (data or "
                            "sequence parallel MoE inside the engine, or routers replaced by a reload)")
            routes = torch.full((tokens, len(self.layers), self.top_k), -1, dtype=self.dtype,
                                device=self.slot_routes.device)
        else:
            routes = torch.stack([ids[:tokens] for ids in self.step], dim=1)  # [tokens, layers, k]
        position = positions[:tokens].to("cpu", torch.int64).numpy()
        slots = np.empty(tokens, dtype=np.int64)
        for index, request_id in enumerate(request_ids):
            begin, end = int(starts[index]), int(starts[index + 1])
            cached = runner.requests[request_id]
            blocks = np.asarray(cached.block_ids[0], dtype=np.int64)
            where = position[begin:end]
            slots[begin:end] = blocks[where // self.block_size] * self.block_size + where % self.block_size
            extra = getattr(cached.sampling_params, "extra_args", None) or {}
            tag = extra.get(ROUTE_CAPTURE_KEY)
            if tag is not None:
                request = self.active.get(request_id)
                if request is None:
                    request = self.active[request_id] = _Request(str(tag), [])
                request.blocks = list(cached.block_ids[0])
                if end > begin:
                    request.length = max(request.length, int(where.max()) + 1)
        index = torch.from_numpy(slots).to(self.slot_routes.device)
        self.slot_routes[index] = routes.to(self.dtype)
        self.slot_tokens[index] = -1 if input_ids is None else input_ids[:tokens].to(torch.int32)

    # ---- read-out ---------------------------------------------------------------------------

    def _finish(self, request_id: str) -> None:
        request = self.active.pop(request_id)
        position = np.arange(request.length, dtype=np.int64)
        block = position // self.block_size
        if request.length and block[-1] >= len(request.blocks):
            raise RuntimeError(f"route capture: request {request_id} has {request.length} tokens but "
                               f"{len(request.blocks)} blocks of {self.block_size}")
        slots = np.asarray(request.blocks, dtype=np.int64)[block] * self.block_size + position % self.block_size
        index = torch.from_numpy(slots).to(self.slot_routes.device)
        done = self.finished.setdefault(request.tag, {})
        self.unclaimed += request_id not in done
        done[request_id] = (self.slot_tokens[index].cpu().numpy(), self.slot_routes[index].cpu().numpy())
        while self.unclaimed > _MAX_UNCLAIMED:  # tags nobody took (a failed generate call)
            self.unclaimed -= len(self.finished.pop(next(iter(self.finished))))

    def take(self, tags: list[str]) -> dict:
        if self.problem is not None:
            raise RuntimeError(f"route capture: {self.problem}")
        wanted = set(tags)
        # Requests of these tags have finished (the client has their completions); the runner may
        # not have been told yet. Their blocks are intact: no forward ran since they finished.
        for request_id in [r for r, request in self.active.items() if request.tag in wanted]:
            self._finish(request_id)
        result = {}
        for tag in tags:
            entries = self.finished.pop(tag, {})
            self.unclaimed -= len(entries)
            result[tag] = [{"request_id": request_id, "tokens": _encode(tokens.astype("<i4")),
                            "routes": _encode(routes.astype(routes.dtype.newbyteorder("<"))),
                            "dtype": routes.dtype.newbyteorder("<").str, "shape": list(routes.shape)}
                           for request_id, (tokens, routes) in entries.items()]
        return result


def _moe_routers(model: torch.nn.Module) -> tuple[list[int], list]:
    """(MoE layer ids ascending, their routers) of a vLLM model; refuses routers vLLM cannot hook."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    found = {}
    for module in model.modules():
        if isinstance(module, MoERunner):
            if module._quant_method.is_monolithic or not isinstance(module.router, BaseRouter):
                raise RuntimeError(f"route capture cannot hook MoE layer {module.layer_id}: its router "
                                   f"{type(module.router).__name__} or a monolithic MoE kernel chooses the experts")
            found[int(module.layer_id)] = module.router
    if not found:
        raise RuntimeError("route capture: the engine's model has no MoE layer (a dense model has no routes)")
    layers = sorted(found)
    return layers, [found[layer] for layer in layers]


def _encode(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")


def _decode(text: str, dtype: str, shape) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype=dtype).reshape(shape)


# ---------------------------------------------------------------------------------------------
# Client side: the vLLM engines' generate.
# ---------------------------------------------------------------------------------------------


def new_tags(count: int) -> list[str]:
    """One capture tag per prompt of a generate call (unique across calls and clients)."""
    base = uuid.uuid4().hex
    return [f"{base}-{index}" for index in range(count)]


def attach_captured_routes(engine: str, group: list[Sample], entries: list[dict], n: int) -> None:
    """Put each sample's captured routes into `sample.extras["routed_experts"]`.

    `entries`: route_capture_take's entries of the prompt's tag. vLLM runs the n samples of a
    prompt as child requests named "<index>_<parent id>", so an entry's sample is its index;
    its token ids must be the sample's prompt and response tokens, every position routed."""
    by_index = {}
    for entry in entries:
        request_id = entry["request_id"]
        index = int(request_id.split("_", 1)[0]) if n > 1 else 0
        if index in by_index:
            raise EngineError(f"{engine}: two captured requests for sample {index} ({request_id})")
        by_index[index] = entry
    for sample in group:
        entry = by_index.get(sample.sample_index)
        if entry is None:
            raise EngineError(f"{engine}: no captured routes for prompt {sample.prompt_index} sample "
                              f"{sample.sample_index}")
        fed = sample.prompt_token_ids + sample.response_token_ids[:-1]
        shape = entry["shape"]
        routes = _decode(entry["routes"], entry["dtype"], shape)
        tokens = _decode(entry["tokens"], "<i4", (shape[0],))
        if shape[0] < len(fed) or tokens[: len(fed)].tolist() != fed:
            raise EngineError(f"{engine}: captured routes of prompt {sample.prompt_index} sample "
                              f"{sample.sample_index} do not match its tokens ({shape[0]} captured, "
                              f"{len(fed)} expected)")
        routes = routes[: len(fed)]
        if (routes < 0).any():
            raise EngineError(f"{engine}: prompt {sample.prompt_index} sample {sample.sample_index}: "
                              f"{int((routes < 0).any(axis=(1, 2)).sum())} tokens without routes (their KV "
                              "was cached before route capture began)")
        sample.extras["routed_experts"] = torch.from_numpy(routes.astype(routes.dtype.newbyteorder("=")))


def native_routes(engine: str, sample: Sample, routed, layers: list[int]) -> torch.Tensor:
    """vLLM's own routes of a sample (GPU, enable_return_routed_experts): [tokens, all layers, k],
    an array (in-process) or a base64 .npy (a completions response) -> the MoE layers' rows."""
    import io

    if routed is None:
        raise EngineError(f"{engine}: the engine returned no routed_experts "
                          "(start it with enable_return_routed_experts)")
    if not isinstance(routed, np.ndarray):
        routed = np.load(io.BytesIO(base64.b64decode(routed)), allow_pickle=False)
    expected = len(sample.prompt_token_ids) + len(sample.response_token_ids) - 1
    if routed.ndim != 3 or routed.shape[0] < expected:
        raise EngineError(f"{engine}: routed_experts of shape {routed.shape}, expected {expected} tokens")
    routed = routed[:expected, layers] if routed.shape[1] > max(layers) else routed[:expected]
    dtype = np.int16 if routed.max(initial=0) <= np.iinfo(np.int16).max else np.int32
    return torch.from_numpy(np.ascontiguousarray(routed).astype(dtype))
