"""The trainer's one handle on rollout: generate on every rank, push weights from every rank.

    rollout = RolloutClient(config, model_dir, master_addr=..., local_rank=..., seed=...)
    groups = rollout.generate(prompts, SamplingParams(...))      # the same samples on every rank
    rollout.sleep()                                              # every rank, before training
    rollout.sync_weights(policy.module, policy.arch)             # every rank, after each update
    rollout.shutdown()

It hides where the engines run. Colocated: every rank drives its share of one engine (SPMD) and
generates the same samples. Servers: global rank 0 (the driver) sends the requests, split over
the servers, and broadcasts the samples. A weight sync is the same sequence for both: the bridge's
HF-named stream (on the ranks the transport needs it; blockwise FP8 when model.export_fp8),
engines paused, the transport's push, prefix caches dropped, engines resumed. A LoRA run with
rollout.lora_push=adapters pushes the base weights that way once, then only the adapters
(rollout/weights/adapters.py). `last_push_bytes` is the bytes the last push carried, on the driver.
With rollout.sleep_level (colocated vLLM on GPU) the engine sleeps while the policy trains, and the
sync wakes it: its weights' memory before the push, its KV cache after it (protocol.Sleeps).

Engines that fail stop every rank at the same point: the driver's error (every server dead, a
refused request) is broadcast with the samples or with the push's dead list, and a colocated
engine's error is agreed on after each generate; every rank raises `RolloutFailed` (pool.py), a
TrainingStopped the trainer answers with the last finished step's checkpoint and one line.

The engines start with the first sync, after the supervised warm start, which never generates:
the warm start's weights are pushed once, and on GPU a colocated engine does not hold its memory
share while the warm start trains. Every rank syncs at the same points, so they start it together.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from megatron_rl.bridge import fp8_rollout_stream
from megatron_rl.config import RunConfig
from megatron_rl.rollout.factory import build_engines, build_transport, torch_dtype
from megatron_rl.rollout.pool import EnginePool, RolloutFailed, rollout_failed
from megatron_rl.rollout.protocol import WAKE_KV_CACHE, WAKE_WEIGHTS, EngineError, RolloutEngine, Sample, SamplingParams
from megatron_rl.rollout.weights.adapters import AdapterPush
from megatron_rl.rollout.weights.stream import ByteCount, hf_weight_stream, pushed_bytes


class RolloutClient:
    def __init__(self, config: RunConfig, model_dir: Path, *, master_addr: str, local_rank: int, seed: int):
        self.config, self.model_dir = config, model_dir
        self.master_addr, self.local_rank, self.seed = master_addr, local_rank, seed
        self.colocated = config.rollout.mode == "colocated"
        self.engines: list[RolloutEngine] | None = None  # this rank's engines (None: not the driver)
        self._requests = None  # the engine, or a pool splitting requests over several
        self.transport = None
        self.adapters: AdapterPush | None = None  # rollout.lora_push=adapters
        self.last_push_bytes = 0
        self.asleep = False  # rollout.sleep_level: the engines sleep between a step's generation and its push

    @property
    def started(self) -> bool:
        return self.transport is not None

    @property
    def drives(self) -> bool:
        """Whether this rank talks to engines (every rank colocated, rank 0 with servers)."""
        return self.engines is not None

    def start(self, arch) -> None:
        if self.config.rollout.lora_push == "adapters":
            self.adapters = AdapterPush(self.config, arch)
        self.engines = build_engines(self.config, self.model_dir, local_rank=self.local_rank, seed=self.seed,
                                     lora=self.adapters.engine_args if self.adapters else None)
        if self.engines is not None:
            # Servers always sit behind a pool: it routes requests to the least busy one (the
            # asynchronous producer sends one request per group) and survives a server's death.
            single = self.colocated and len(self.engines) == 1
            self._requests = self.engines[0] if single else EnginePool(self.engines)
        self.transport = build_transport(self.config, self.master_addr)
        self.transport.connect(self.engines)

    # ---- generation ---------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Sample]]:
        timeout = self.config.rollout.request_timeout_s
        groups = None
        if self.drives:
            try:
                groups = self._requests.generate(prompts, params, timeout_s=timeout)
            except Exception as exc:  # noqa: BLE001 - every rank raises it, none waits for the driver
                groups = rollout_failed("generate", exc, in_process=self.colocated)
        if self.colocated:  # each rank its own answer: whether any failed is agreed on
            failures = [None] * dist.get_world_size()
            dist.all_gather_object(failures, str(groups) if isinstance(groups, BaseException) else None)
            failed = next((rank for rank, failure in enumerate(failures) if failure is not None), None)
            if isinstance(groups, BaseException):
                raise groups
            if failed is not None:
                raise RolloutFailed(f"{failures[failed]} (on rank {failed})")
            return groups
        holder = [groups]
        dist.broadcast_object_list(holder, src=0)
        if isinstance(holder[0], BaseException):
            raise holder[0]
        return holder[0]

    # ---- sleep mode ---------------------------------------------------------------------------

    def sleep(self) -> None:
        """Every rank, once the step's generation is done and before training: with
        rollout.sleep_level the engines release their memory while the policy trains (level 1
        offloads the weights to host memory, level 2 discards them; both free the KV cache). The
        next sync_weights wakes them. Colocated only (the config refuses servers)."""
        level = self.config.rollout.sleep_level
        if level and self.started and not self.asleep:
            self._on_every_rank("sleep", "sleep", level)
            self.asleep = True

    def _on_every_rank(self, action: str, method: str, *args) -> None:
        """`method(*args)` on this rank's colocated engine shares, every rank together: a failure on
        any rank is RolloutFailed on all of them (vLLM's tensor parallel group spans the ranks)."""
        error = None
        try:
            for engine in self.engines:
                getattr(engine, method)(*args)
        except Exception as exc:  # noqa: BLE001 - every rank raises it, none waits for the others
            error = rollout_failed(action, exc, in_process=True)
        failures = [None] * dist.get_world_size()
        dist.all_gather_object(failures, str(error) if error is not None else None)
        if error is not None:
            raise error
        failed = next((rank for rank, failure in enumerate(failures) if failure is not None), None)
        if failed is not None:
            raise RolloutFailed(f"{failures[failed]} (on rank {failed})")

    # ---- weights ------------------------------------------------------------------------------

    @property
    def pool(self) -> EnginePool:
        """The driver's servers (asynchronous rollout sends its requests through it)."""
        if self.colocated or not isinstance(self._requests, EnginePool):
            raise RuntimeError("RolloutClient.pool: only the driver of server engines has a pool")
        return self._requests

    def sync_weights(self, module, arch, *, pause_mode: str = "wait") -> int:
        """Every trainer rank: the policy's current weights into every engine. Returns the number
        of tensors each engine loaded. `pause_mode` "abort" (partial rollouts, servers only): the
        engines' in-flight requests end at once and return what they have, to be continued on
        the new weights; "wait": they finish first."""
        if not self.started:
            self.start(arch)
        adapters = self.adapters
        # The whole model (merged), or with adapters pushed apart the base W, once.
        stream = None if adapters is not None and adapters.base_pushed else ByteCount(
            self._model_stream(module, arch, merge_adapters=adapters is None))
        try:
            if self.drives and pause_mode == "wait":
                self._requests.pause()
            elif self.drives:
                self._requests.pause(pause_mode)  # servers only: a pool passes the mode on
        except Exception as exc:  # noqa: BLE001 - with servers every rank hears of it below
            if self.colocated:
                raise rollout_failed("take the weights", exc, in_process=True) from None
            paused = rollout_failed("take the weights", exc)
        else:
            paused = None
        if not self.colocated:
            # Servers that died since the last push (the pool moved their requests to the others)
            # leave the transport on every rank before it pushes; a failed pause stops every rank.
            dead = [(self._requests.dead, paused) if self.drives else None]
            dist.broadcast_object_list(dead, src=0)
            if dead[0][1] is not None:
                raise dead[0][1]
            self._transport("drop", dead[0][0])
        if self.asleep:  # its weights' memory back (level 2: empty until this push fills it)
            self._on_every_rank("wake up", "wake_up", WAKE_WEIGHTS)
        count, sent = 0, 0
        if stream is not None:
            count = self._transport("push", stream)
            sent = pushed_bytes(stream.bytes, self.transport.destination)
        if adapters is not None:  # colocated (config/run.py): every rank loads its share
            adapters.base_pushed = True
            tensors = adapters.tensors(module, arch, torch_dtype(self.config))
            count += self.engines[0].update_adapters(tensors, adapters.adapter_config(tensors))
            sent += sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        self.last_push_bytes = sent
        if self.asleep:  # the KV cache only now: the push ran without it beside the weights
            self._on_every_rank("wake up", "wake_up", WAKE_KV_CACHE)
            self.asleep = False
        resumed = None
        if self.drives:
            try:
                self._requests.reset_prefix_cache()
                self._requests.resume()
            except Exception as exc:  # noqa: BLE001 - every rank raises it, none waits for the driver
                resumed = rollout_failed("take the weights", exc, in_process=self.colocated)
        if not self.colocated:
            holder = [resumed]
            dist.broadcast_object_list(holder, src=0)
            resumed = holder[0]
        if resumed is not None:
            raise resumed
        return count

    def _transport(self, method: str, *args):
        """A transport call; an engine's error becomes RolloutFailed, the run's one-line stop (an
        error that reaches one rank only still leaves the others in the transport's collective)."""
        try:
            return getattr(self.transport, method)(*args)
        except EngineError as exc:
            raise rollout_failed("take the weights", exc) from None

    def _model_stream(self, module, arch, *, merge_adapters: bool):
        stream = hf_weight_stream(module, arch, destination=self.transport.destination,
                                  bucket_bytes=self.config.rollout.weight_bucket_mb << 20,
                                  dtype=torch_dtype(self.config), merge_adapters=merge_adapters)
        if self.config.model.export_fp8:
            # Engines serving FP8 get blockwise e4m3 weights with their scales (the HF FP8
            # format), quantized exactly as the FP8 checkpoint export does.
            stream = fp8_rollout_stream(stream, arch)
        return stream

    def shutdown(self) -> None:
        if self.transport is not None:
            self.transport.close()
        if self._requests is not None:
            self._requests.shutdown()
