"""The weight-sync checks of benchmarks/gpu_engine.py (push, colocated, server) and what every check
shares: the trainer's side of one RL step in one process, the engine through the project's own
rollout client (rollout/client.py), and the comparison of the engine's logprobs with the trainer's.

Each check is a function of (device, options) -> {"figures", "checks"}; device is "cuda" on the GPU
machine and "cpu" in the dry run, where vLLM's CPU build stands in for the GPU engine.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

# fp32 policy and fp32 engine: only the order of reductions differs (the CPU suite's bound,
# tests/rollout/test_vllm_sync.py).
FP32_TOLERANCE = {"max": 1e-4, "mean": 1e-5}
# bf16 policy (Megatron-Core's local spec) against a bf16 vLLM engine: the same weights, but other
# kernels (FlashAttention, Triton's fused MoE, cuBLAS with other splits) round each matmul's bf16
# output (8 significant bits, 2^-9 relative) at other points. Through two layers into logits of a
# few units that moves a sampled token's logprob by a few hundredths; the bound is the one the GPU
# kit holds the same bf16 step to, GPU against CPU (gpu_verify_stages.STEP_TOLERANCES).
BF16_TOLERANCE = {"max": 0.1, "mean": 0.01}
# Before a push the engine serves the old weights: the same comparison must then fail by this much.
STALE_FACTOR = 10
# Both sleep levels, one engine (vLLM takes the level per sleep() call): 1 offloads the weights to
# host memory, 2 discards them, with every buffer that is not a parameter (the push restores only
# parameters). Level 2 has had wrong outputs after waking in vLLM (the rotary cache discarded: fixed
# by saving named buffers; "sleep level 2 causes gibberish outputs" is still reported), so after each
# level's wake and push the engine's logprobs are held to the trainer's like any other push's.
SLEEP_LEVELS = (1, 2)
PROMPTS = [[3, 17, 99, 250, 7], [42, 311, 5], [480, 64, 128, 2, 77, 199], [13, 401, 9, 333],
           [7, 7, 300, 21], [95, 12, 412, 8, 66, 3, 150], [270, 31], [5, 440, 123, 18, 9]]


def check(name: str, value: float, tolerance: float, ok: bool | None = None) -> dict:
    return {"check": name, "value": float(value), "tolerance": float(tolerance),
            "ok": bool(value <= tolerance) if ok is None else bool(ok)}


class Step:
    """The trainer's side of an RL step in this process: config, runtime, policy and the rollout
    client the trainer would hold, its engine started from a local config and tokenizer with dummy
    weights (the first push makes it the trainer's)."""

    def __init__(self, device: str, out: Path, overrides: list[str], *, lr: float = 1e-3):
        from megatron_rl.config import load_config
        from megatron_rl.model.policy import Policy
        from megatron_rl.rollout.client import RolloutClient
        from megatron_rl.rollout.engine_model import write_engine_model_dir
        from megatron_rl.runtime import start_runtime

        out.mkdir(parents=True, exist_ok=True)
        self.device = device
        # Megatron-Core's local layers whatever is installed (layer_spec auto takes Transformer Engine's
        # where it finds it): the stage checks the engine, not TE.
        self.config = load_config(None, [f"device={device}", f"output_dir={out}", f"optimizer.lr={lr}",
                                         "model.layer_spec=local", "rollout.max_model_len=256",
                                         "rollout.weight_bucket_mb=1", *overrides])
        self.runtime = start_runtime(self.config)
        self.policy = Policy(self.config, self.runtime)
        self.model_dir = write_engine_model_dir(self.config, out / "engine_model")
        self.client = RolloutClient(self.config, self.model_dir, master_addr=self.runtime.launch.master_addr,
                                    local_rank=self.runtime.launch.local_rank, seed=self.config.seed)
        self.pushes: list[dict] = []

    def start_engine(self) -> float:
        started = time.perf_counter()
        self.client.start(self.policy.arch)
        return time.perf_counter() - started

    @property
    def engine(self):
        return self.client.engines[0]

    def push(self) -> dict:
        """One weight sync through the client (pause, the transport's push, resume), timed."""
        synchronize(self.device)
        started = time.perf_counter()
        tensors = self.client.sync_weights(self.policy.module, self.policy.arch)
        synchronize(self.device)
        seconds = time.perf_counter() - started
        sent = self.client.last_push_bytes
        record = {"tensors": tensors, "bytes": sent, "seconds": round(seconds, 4),
                  "GB/s": round(sent / seconds / 1e9, 4) if seconds > 0 else None}
        self.pushes.append(record)
        return record

    def generate(self, seed: int, max_tokens: int = 24, return_routed_experts: bool = False):
        return generate(self.client, seed, max_tokens, return_routed_experts)

    def batches(self, samples, token_budget: int = 512):
        from megatron_rl.model.packing import pack_by_token_budget

        sequences = [s.prompt_token_ids + s.response_token_ids for s in samples]
        return pack_by_token_budget(sequences, [len(s.prompt_token_ids) for s in samples], token_budget,
                                    self.policy.pad_to_multiple)

    def trainer_logprobs(self, samples, batches=None, routing=None) -> list[torch.Tensor]:
        """The policy's logprob of every response token of every sample (float64, on the CPU);
        `batches`: the samples packed already (a routing trace's micro-batches)."""
        batches = self.batches(samples) if batches is None else batches
        outputs = self.policy.logprobs(batches, with_entropy=False, routing=routing)
        result: list = [None] * len(samples)
        for batch, output in zip(batches, outputs):
            for sample_id, values in zip(batch.sample_ids, batch.response_values(output["logprobs"])):
                result[sample_id] = values.detach().double().cpu()
        return result

    def mismatch(self, samples, batches=None, routing=None) -> dict:
        """|engine logprob - trainer logprob| over every response token: max and mean."""
        return spread([torch.tensor(s.logprobs, dtype=torch.float64) - ref
                       for s, ref in zip(samples, self.trainer_logprobs(samples, batches, routing))])

    def train(self, samples, steps: int) -> dict:
        """`steps` optimizer steps raising the likelihood of the samples (the weights move), with
        the GPU's free memory after the last (torch keeps the step's peak reserved)."""
        from megatron_rl.algorithms import compute_step_normalizer

        batches = self.batches(samples, token_budget=256)
        normalizer = compute_step_normalizer([b.loss_mask for b in batches], group=self.policy.dp_group,
                                             device=self.runtime.device).num_tokens
        for _ in range(steps):
            result = self.policy.train_step(batches, lambda lp, ent, b: (-(lp * b.loss_mask[0]).sum() / normalizer, {}))
            if not result.updated:
                raise RuntimeError(f"the training step did not update the weights (grad norm {result.grad_norm})")
        return {"loss": result.loss, **gpu_memory(self.device)}

    def close(self) -> None:
        self.client.shutdown()
        self.runtime.shutdown()


def generate(client, seed: int, max_tokens: int = 24, return_routed_experts: bool = False):
    """The step's samples: 4 per prompt, each max_tokens long (EOS ignored: equal lengths)."""
    from megatron_rl.rollout import SamplingParams

    params = SamplingParams(n=4, temperature=1.0, max_tokens=max_tokens, seed=seed, ignore_eos=True,
                            return_routed_experts=return_routed_experts)
    return [sample for group in client.generate(PROMPTS, params) for sample in group]


def spread(differences: list[torch.Tensor]) -> dict:
    diffs = torch.cat(differences).abs()
    return {"max": float(diffs.max()), "mean": float(diffs.mean()), "tokens": int(diffs.numel())}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def gpu_memory(device: str) -> dict:
    if device != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"GPU free GiB": round(free / 2**30, 2), "GPU total GiB": round(total / 2**30, 2),
            "trainer peak allocated GiB": round(torch.cuda.max_memory_allocated() / 2**30, 3)}


def sync_round(step: Step, label: str, tolerance: dict, seed: int, checks: list, figures: dict) -> list:
    """Push, generate the step's samples, and hold the engine's logprobs to the trainer's."""
    figures[f"{label}: push"] = step.push()
    samples = step.generate(seed)
    found = step.mismatch(samples)
    figures[f"{label}: engine vs trainer logprobs"] = found
    checks.append(check(f"{label}: max abs(engine - trainer) logprob", found["max"], tolerance["max"]))
    checks.append(check(f"{label}: mean abs(engine - trainer) logprob", found["mean"], tolerance["mean"]))
    return samples


def stale_round(step: Step, samples, label: str, tolerance: dict, train_steps: int, checks: list,
                figures: dict) -> None:
    """Train without pushing: the engine's logprobs must now differ from the trainer's, far beyond
    the tolerance (else the comparison could not fail)."""
    figures[f"{label}: training"] = step.train(samples, train_steps)
    stale = step.mismatch(step.generate(seed=100 + len(step.pushes)))
    figures[f"{label}: engine vs trainer logprobs without a push"] = stale
    checks.append(check(f"{label}: without a push the mean mismatch exceeds {STALE_FACTOR}x its tolerance",
                        stale["mean"], STALE_FACTOR * tolerance["mean"], ok=stale["mean"] > STALE_FACTOR * tolerance["mean"]))


def push_rounds(step: Step, tolerance: dict, checks: list, figures: dict) -> None:
    """Three pushes (the first into dummy weights; the later ones in place), two trainings between."""
    samples = sync_round(step, "push 1 (into dummy weights)", tolerance, 1, checks, figures)
    stale_round(step, samples, "after push 1", tolerance, 3, checks, figures)
    samples = sync_round(step, "push 2", tolerance, 2, checks, figures)
    figures["after push 2: training"] = step.train(samples, 1)
    sync_round(step, "push 3", tolerance, 3, checks, figures)


def precision_of(device: str) -> str:
    """bf16 on the GPU; fp32 in the dry run (vLLM's CPU build runs bf16 only on some CPUs)."""
    return "bf16" if device == "cuda" else "fp32"


def check_push(device: str, options: dict) -> dict:
    """fp32 policy and fp32 colocated engine: the bridge's bucket stream in process (1 MiB
    buckets), engine logprobs equal the trainer's after every push."""
    step = Step(device, Path(options["out_dir"]) / "push", ["model.precision=fp32", "rollout.mode=colocated",
                                                             "rollout.gpu_memory_utilization=0.3"])
    figures, checks = {"precision": "fp32 policy, fp32 engine", "transport": "stream (in process)"}, []
    try:
        figures["engine start s"] = round(step.start_engine(), 2)
        push_rounds(step, FP32_TOLERANCE, checks, figures)
    finally:
        step.close()
    return {"figures": figures, "checks": checks}


def check_colocated(device: str, options: dict) -> dict:
    """The engine inside the trainer's process, memory shared: trained with the engine awake, then
    asleep at each of SLEEP_LEVELS (the client's sleep() before training, its next push wakes the
    engine), free GPU memory during each training, the engine's logprobs after every push."""
    precision = precision_of(device)
    overrides = [f"model.precision={precision}", "rollout.mode=colocated", "rollout.gpu_memory_utilization=0.3"]
    overrides += [f"rollout.sleep_level={SLEEP_LEVELS[0]}"] if device == "cuda" else []
    tolerance = BF16_TOLERANCE if precision == "bf16" else FP32_TOLERANCE
    step = Step(device, Path(options["out_dir"]) / "colocated", overrides, lr=1e-2 if precision == "bf16" else 1e-3)
    figures = {"precision": f"{precision} policy, {precision} engine", "tolerance": tolerance,
               "gpu_memory_utilization": step.config.rollout.gpu_memory_utilization,
               "sleep levels": list(SLEEP_LEVELS) if device == "cuda" else []}
    checks = []
    try:
        figures["engine start s"] = round(step.start_engine(), 2)
        figures["GPU memory with policy and engine"] = gpu_memory(device)
        samples = sync_round(step, "push 1", tolerance, 1, checks, figures)
        stale_round(step, samples, "training, engine awake", tolerance, 2, checks, figures)
        samples = sync_round(step, "push 2", tolerance, 2, checks, figures)
        if device != "cuda":
            return {"figures": figures, "checks": checks, "gpu_only": {
                "sleep mode and free GPU memory": "vLLM's sleep mode frees memory of CUDA's allocator (CuMemAllocator); "
                                                  "its CPU build has none"}}
        for push, level in enumerate(SLEEP_LEVELS, start=3):
            samples = sleep_round(step, level, samples, push, tolerance, checks, figures)
    finally:
        step.close()
    return {"figures": figures, "checks": checks}


def sleep_round(step: Step, level: int, samples, push: int, tolerance: dict, checks: list, figures: dict) -> list:
    """Sleep at `level` through the client, as a run with rollout.sleep_level=level does; train
    (free GPU memory against the awake training's); the next push wakes the engine (weights first,
    the push, then the KV cache) and its logprobs must be the trainer's."""
    rollout = dataclasses.replace(step.config.rollout, sleep_level=level)
    step.client.config = dataclasses.replace(step.config, rollout=rollout)
    started = time.perf_counter()
    step.client.sleep()
    figures[f"sleep (level {level}) s"] = round(time.perf_counter() - started, 3)
    figures[f"GPU memory, engine asleep (level {level})"] = gpu_memory(step.device)
    asleep = figures[f"training, engine asleep (level {level})"] = step.train(samples, 2)
    freed = round(asleep["GPU free GiB"] - figures["training, engine awake: training"]["GPU free GiB"], 2)
    figures[f"GPU memory freed during training by sleep level {level} GiB"] = freed
    checks.append(check(f"sleep level {level} frees GPU memory during training (GiB, must be > 0)", freed, 0,
                        ok=freed > 0))
    return sync_round(step, f"push {push} (wakes the engine from level {level})", tolerance, push, checks, figures)


def check_server(device: str, options: dict) -> dict:
    """rollout.mode=server: one vLLM HTTP server (on the same GPU) taking the files transport,
    checked as the colocated push is. `server_url` (dry run): a running server of the tiny default
    model instead of one started here."""
    out = Path(options["out_dir"]) / "server"
    overrides = ["model.precision=fp32", "rollout.mode=server", "rollout.weight_transport=files", "rollout.num_servers=1",
                 "rollout.gpu_memory_utilization=0.3", f"rollout.staging_dir={out / 'staging'}",
                 "rollout.startup_timeout_s=300", "rollout.request_timeout_s=120"]
    if options.get("server_url"):
        overrides.append(f"rollout.server_urls=[{options['server_url']}]")
    step = Step(device, out, overrides)
    figures = {"precision": "fp32 policy, fp32 server", "transport": "files (safetensors, 1 MiB buckets)",
               "server": options.get("server_url") or "started here, dummy weights"}
    checks = []
    try:
        figures["server start s"] = round(step.start_engine(), 2)
        push_rounds(step, FP32_TOLERANCE, checks, figures)
    finally:
        step.close()
    return {"figures": figures, "checks": checks}
