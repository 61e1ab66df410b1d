"""vLLM inside the trainer's own processes (colocated; the default on CPU).

Every trainer rank builds one vLLM engine with `distributed_executor_backend="external_launcher"`:
vLLM then joins the trainer's existing torch.distributed world and shards the model with tensor
parallelism across all ranks (vLLM's TP size = trainer world size). Generation is SPMD: every rank
calls `generate` with the same prompts and gets the same samples. Measured on the CPU build: the
plain single-process engine ("uni") hangs inside a torchrun world of 2 (vLLM builds its groups
over the whole existing world), and vLLM data parallelism with MoE is not implemented on CPU, so
the shared-world TP engine is the one colocated layout that works everywhere.

Weights travel by reference: every rank passes the full HF-named stream (see
`megatron_rl.rollout.weights.stream`) to its own worker, which keeps its TP slice. With `lora`
(rollout.lora_push=adapters, rollout/engines/vllm_lora.py) the engine runs vLLM's own LoRA: after
the base weights, `update_adapters` loads each push's adapters and every request carries them.

With `sleep_mode` (rollout.sleep_level > 0; GPU only) the engine releases its memory while the
policy trains: `sleep(level)` after the step's generation, `wake_up(WAKE_WEIGHTS)` before the push,
`wake_up(WAKE_KV_CACHE)` after it (protocol.Sleeps; the rollout client calls them). vLLM's CPU
build has no sleep mode: it refuses enable_sleep_mode on its CPU platform, and its CPU worker
ignores sleep(), so this engine refuses sleep_mode there by name (preflight does first).
"""

from __future__ import annotations

import gc
import json
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from megatron_rl.runtime.cpu.megatron_patches import suspended
from megatron_rl.rollout.protocol import (
    EngineError,
    EngineUnavailable,
    Sample,
    SamplingParams,
    WAKE_KV_CACHE,
    WAKE_WEIGHTS,
    WeightStream,
    check_grouping,
)
from megatron_rl.rollout.worker.route_capture import ROUTE_CAPTURE_KEY, attach_captured_routes, native_routes, new_tags
from megatron_rl.rollout.engines.vllm_common import (
    LOGPROBS_MODE,
    cpu_kernel_args,
    samples_from_request_output,
    to_vllm_sampling,
    vllm_environment,
)
from megatron_rl.rollout.worker.extension import WORKER_EXTENSION
from megatron_rl.rollout.engines.vllm_lora import ADAPTER_NAME, check_engine_targets
from megatron_rl.runtime.cpu.vllm_repairs import (fix_cpu_moe_kernel_with_lora, fix_cpu_rotary_embedding,
                                                  fix_cpu_seeded_chunked_prefill)


class VllmColocatedEngine:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "float32",
        max_model_len: int = 1024,
        seed: int = 0,
        cache_dir: str | Path | None = None,
        cpu_kv_cache_gib: float = 1.0,
        gpu_memory_utilization: float = 0.5,
        load_format: str = "auto",
        local_rank: int = 0,
        name: str = "vllm-colocated",
        engine_args: dict | None = None,
        lora: dict | None = None,
        sleep_mode: bool = False,
    ):
        """`load_format="dummy"` starts from random weights (no checkpoint on disk needed); the
        caller must then push weights before generating, as the trainer does at start-up.
        `engine_args`: further `vllm.LLM` arguments (e.g. enable_return_routed_experts on GPU).
        `lora`: vLLM's LoRA arguments (vllm_lora.engine_lora_args) for adapter pushes.
        `sleep_mode`: vLLM's sleep mode (enable_sleep_mode), for `sleep` / `wake_up`; GPU only."""
        self.name = name
        on_cpu = not torch.cuda.is_available()
        if sleep_mode and on_cpu:
            raise EngineError(f"{self.name}: sleep mode (rollout.sleep_level > 0) needs a GPU: vLLM's CPU build has "
                              f"none (its CPU worker ignores sleep); set rollout.sleep_level: 0")
        os.environ.update(vllm_environment(cache_dir, on_cpu=on_cpu, kv_cache_gib=cpu_kv_cache_gib))
        if on_cpu and os.environ.get("TORCH_COMPILE_DISABLE") == "1":
            # torch read TORCH_COMPILE_DISABLE when it was imported, long before this engine: set
            # what it sets. Otherwise the sampler's first call compiles (3-20 s on 2 cores) for
            # nothing the trainer reads. The trainer itself compiles nothing on CPU.
            from torch._dynamo import config as dynamo_config

            dynamo_config.disable = True
        # The engine core must live in this process: a child process could not share the
        # trainer's world, and tensors could not be passed by reference.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        # The worker lives in this process and imported worker/extension.py before vLLM: apply its
        # pre-build fixes here (the server's workers get them when vLLM imports the extension).
        engine_args = dict(engine_args or {})
        if on_cpu:
            fix_cpu_rotary_embedding()
            fix_cpu_seeded_chunked_prefill()
            engine_args.update(cpu_kernel_args(model_dir, dtype))
            if lora:
                fix_cpu_moe_kernel_with_lora()
        engine_args.update(lora or {})
        if sleep_mode:
            engine_args["enable_sleep_mode"] = True
        self.lora_targets: list[str] = list((lora or {}).get("lora_target_modules", ()))
        self._lora_request = None  # the adapter every request carries (the last one pushed)
        self._lora_ids = 0

        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        world = torch.distributed.get_world_size() if distributed else 1
        if distributed:
            # vLLM's external launcher reads the rank from torchrun's variables; a SLURM task or a
            # single process started by us does not have them.
            os.environ.setdefault("RANK", str(torch.distributed.get_rank()))
            os.environ.setdefault("LOCAL_RANK", str(local_rank))
        # Shared memory between the engine's ranks (CPU build): named for this run, after the
        # segments dead runs left are gone, and removed by this run when the engine shuts down or
        # the process exits, whichever comes first (runtime/cpu/vllm_shm.py).
        shm_names = nullcontext()
        self._shm = None
        if on_cpu and distributed:
            from megatron_rl.runtime.cpu.vllm_shm import (RunSegments, remove_stale_segments, run_identifier,
                                                          segments_named_for)

            if int(os.environ["LOCAL_RANK"]) == 0:
                remove_stale_segments(notify=lambda line: print(f"[megatron-rl] {line}", flush=True))
            identifier = run_identifier()  # collective
            self._shm = RunSegments(identifier)
            shm_names = segments_named_for(identifier)
        started = time.perf_counter()
        # vLLM runs gc.collect() about five times while it starts; over a heap that already holds
        # torch, Megatron-Core, transformers and the policy, each took ~0.3 s on 2 cores (1.4 s
        # in all). Everything alive now lives for the whole run, so move it out of the
        # collector's view first, as vLLM itself does once it has started (freeze_gc_heap).
        gc.freeze()
        # vLLM's CPU build names no CUDA device: it runs without Megatron's CPU redirection (a
        # Python call per torch op otherwise), here and in generate / update_weights.
        with suspended(), shm_names:
            self._llm = LLM(
                model=str(model_dir),
                dtype=dtype,
                max_model_len=max_model_len,
                seed=seed,
                tensor_parallel_size=world,
                distributed_executor_backend="external_launcher" if distributed else "uni",
                enforce_eager=on_cpu,  # CUDA graphs on GPU; nothing to capture on CPU
                gpu_memory_utilization=gpu_memory_utilization,
                load_format=load_format,
                worker_extension_cls=WORKER_EXTENSION,
                logprobs_mode=LOGPROBS_MODE,  # logprobs after temperature: what the trainer trains on
                **engine_args,
            )
        self.startup_s = time.perf_counter() - started
        self.sleep_mode = sleep_mode
        self._asleep: set[str] = set()  # the parts of its memory the engine released (sleep)
        self._weights_discarded = False  # level 2: what it serves is undefined until the next push
        self._paused = False
        self._closed = False
        self.weights_loaded = load_format != "dummy"

    def generate(self, prompts: list[list[int]], params: SamplingParams, timeout_s: float | None = None) -> list[list[Sample]]:
        """`timeout_s` is not enforceable here: the engine runs on this thread (an SPMD step on every
        rank); a hang is bounded by the trainer's collective timeout instead."""
        self._check_usable()
        from vllm.inputs import TokensPrompt

        sampling = [to_vllm_sampling(params, index) for index in range(len(prompts))]
        # R3: the engine's MoE routes of every sample (rollout/worker/route_capture.py).
        layout = self._route_layout() if params.return_routed_experts else None
        tags = new_tags(len(prompts)) if layout is not None and not layout["native"] else None
        for vllm_params, tag in zip(sampling, tags or []):
            vllm_params.extra_args = {**(vllm_params.extra_args or {}), ROUTE_CAPTURE_KEY: tag}
        with suspended():
            outputs = self._llm.generate(
                [TokensPrompt(prompt_token_ids=list(prompt)) for prompt in prompts],
                sampling,
                use_tqdm=False,
                lora_request=self._lora_request,
            )
            captured = self._llm.collective_rpc("route_capture_take", args=(json.dumps(tags),))[0] if tags else None
        groups = [samples_from_request_output(self.name, index, prompt, output)
                  for index, (prompt, output) in enumerate(zip(prompts, outputs))]
        check_grouping(self.name, prompts, params, groups)
        for group, output, tag in zip(groups, outputs, tags or [None] * len(groups)):
            if tag is not None:
                attach_captured_routes(self.name, group, captured[tag], params.n)
            elif layout is not None:  # vLLM's own capture (GPU, enable_return_routed_experts)
                completions = sorted(output.outputs, key=lambda completion: completion.index)
                for sample, completion in zip(group, completions):
                    sample.extras["routed_experts"] = native_routes(self.name, sample, completion.routed_experts,
                                                                    layout["layers"])
        return groups

    def _route_layout(self) -> dict:
        """The engine's route capture, started on first use (route_capture.RouteCaptureWorker)."""
        layout = getattr(self, "_routes", None)
        if layout is None:
            with suspended():
                (layout,) = self._llm.collective_rpc("route_capture_enable")
                if not layout["native"]:
                    self._llm.reset_prefix_cache()  # no cached prefix may predate the capture
            self._routes = layout
        return layout

    def update_weights(self, weights: WeightStream) -> int:
        if self._closed:
            raise EngineUnavailable(f"{self.name}: engine was shut down")
        with suspended():
            (count,) = self._llm.collective_rpc("update_weights_from_stream", args=(weights,))
            # Cached prefixes hold KV computed with the old weights.
            self._llm.reset_prefix_cache()
        if count == 0:
            raise EngineError(f"{self.name}: weight update received no tensors")
        self.weights_loaded = True
        self._weights_discarded = False
        return count

    def update_adapters(self, tensors: dict[str, torch.Tensor], adapter_config: dict) -> int:
        """Load LoRA adapters (PEFT names, whole) under a fresh id and serve every later request
        with them; the base weights stay. Returns the number of tensors loaded."""
        if self._closed:
            raise EngineUnavailable(f"{self.name}: engine was shut down")
        if not self.lora_targets:
            raise EngineError(f"{self.name}: started without LoRA (rollout.lora_push=merged); it takes merged weights")
        if not tensors:
            raise EngineError(f"{self.name}: adapter push received no tensors")
        check_engine_targets(tensors, self.lora_targets)  # vLLM would drop the others silently
        from vllm.lora.request import LoRARequest

        self._lora_ids += 1
        lora_id, name = self._lora_ids, f"{ADAPTER_NAME}-{self._lora_ids}"
        with suspended():
            self._llm.collective_rpc("load_lora_adapter", args=(lora_id, tensors, adapter_config))
            # A fresh name is a fresh prefix-cache key already; no KV of an older adapter stays either.
            self._llm.reset_prefix_cache()
        # Loaded in memory: vLLM never reads the path unless it evicted the adapter (it cannot, with
        # room for two), and then fails loudly on this one, which does not exist.
        self._lora_request = LoRARequest(name, lora_id, f"/in-memory/{name}")
        return len(tensors)

    def reset_prefix_cache(self) -> None:
        with suspended():
            self._llm.reset_prefix_cache()

    # A colocated engine shares the trainer's processes: weights come by reference (update_weights),
    # never over files or a network group, so it has neither FileWeights nor CollectiveWeights.

    def fingerprint(self) -> dict | None:
        """None after a level-2 sleep until the next push: the weights were discarded on purpose, so
        what the engine serves says nothing about what was pushed (the push's own check follows)."""
        if self._weights_discarded:
            return None
        return self._llm.collective_rpc("weights_fingerprint")[0]

    # ---- sleep mode (protocol.Sleeps; GPU only) ------------------------------------------------

    def sleep(self, level: int) -> None:
        """Level 1: weights offloaded to host memory, KV cache discarded; level 2: both discarded
        (the next push restores the weights). Generation is refused until every part is awake."""
        self.health()
        if not self.sleep_mode:
            raise EngineError(f"{self.name}: started without sleep mode (rollout.sleep_level: 0); cannot sleep")
        if level not in (1, 2):
            raise EngineError(f"{self.name}: sleep level must be 1 or 2, got {level}")
        if self._asleep:
            raise EngineError(f"{self.name}: sleep called while asleep ({', '.join(sorted(self._asleep))})")
        with suspended():
            self._llm.sleep(level=level)  # frees the prefix cache with the KV cache
        self._asleep = {*WAKE_WEIGHTS, *WAKE_KV_CACHE}
        self._weights_discarded = level == 2

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        """`tags`: WAKE_WEIGHTS, WAKE_KV_CACHE, or None (both). Waking what is awake is a no-op."""
        self.health()
        parts = {*WAKE_WEIGHTS, *WAKE_KV_CACHE} if tags is None else set(tags)
        unknown = parts - {*WAKE_WEIGHTS, *WAKE_KV_CACHE}
        if unknown:
            raise EngineError(f"{self.name}: wake_up tags must be among {WAKE_WEIGHTS + WAKE_KV_CACHE}, "
                              f"got {sorted(unknown)}")
        parts &= self._asleep
        if not parts:
            return
        with suspended():
            self._llm.wake_up(tags=sorted(parts))  # vLLM resumes scheduling once every part is back
        self._asleep -= parts

    def pause(self) -> None:
        # Generation here is synchronous, so pausing means refusing generate until resume; releasing
        # the engine's memory for training is sleep() (rollout.sleep_level, GPU only).
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    def health(self) -> None:
        if self._closed:
            raise EngineUnavailable(f"{self.name}: engine was shut down")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Not vLLM's own engine-core shutdown: it ends with cleanup_dist_env_and_memory, which
        # destroys torch's default process group, i.e. the trainer's world. vLLM also registers
        # that shutdown to run when the engine is garbage collected, so detach it, then release
        # the worker's model, KV cache and scheduler ourselves. vLLM's subgroups of the world
        # live until the process ends (destroying them would pass None, the default group, for
        # a world-sized group).
        client = self._llm.llm_engine.engine_core
        client._finalizer.detach()  # private, but the only handle on that registered shutdown
        core = client.engine_core
        try:
            # vLLM's worker shutdown unfreezes the collector's frozen heap and collects all of it
            # (gc.unfreeze(), then gc.collect() in its model runner's cleanup): 0.6 s on 2 cores
            # over the heap torch, Megatron-Core, transformers, vLLM and the policy fill, at the
            # end of every run. The tensors it drops go with their last reference; the heap is
            # unfrozen afterwards as vLLM leaves it, and what cycles hold waits for the
            # interpreter's next full collection (none when the process ends first).
            unfreeze, collect = gc.unfreeze, gc.collect
            gc.unfreeze, gc.collect = (lambda: None), (lambda generation=2: 0)
            try:
                core.model_executor.shutdown()
            finally:
                gc.unfreeze, gc.collect = unfreeze, collect
                gc.unfreeze()
            core.scheduler.shutdown()
            del self._llm
        finally:
            # vLLM unlinks its CPU shared memory only in a C++ destructor at the process's C exit(),
            # which a process ending with os._exit never reaches: this engine's segments go now,
            # on every rank (each unlinks the run's names on its host; a rank still mapping one is
            # unaffected, and vLLM opens them by name only while the engine starts).
            if self._shm is not None:
                self._shm.release()
            # The TP group's message queue (24 MiB of /dev/shm/psm_*, made by its rank 0): vLLM
            # frees it only when the group is destroyed, which the trainer's world forbids, or
            # through Python's resource tracker at exit (a leak warning; nothing if it is killed).
            from megatron_rl.runtime.cpu.vllm_shm import release_message_queues

            release_message_queues()

    def _check_usable(self) -> None:
        self.health()
        if self._paused:
            raise EngineError(f"{self.name}: generate called while paused; call resume() first")
        if self._asleep:
            raise EngineError(f"{self.name}: generate called while asleep ({', '.join(sorted(self._asleep))}); "
                              f"call wake_up() first")
        if not self.weights_loaded:
            raise EngineError(f"{self.name}: started with dummy weights and none were pushed yet")
