"""What both vLLM engines (colocated and server) share: environment, sampling and output conversion."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from megatron_rl.rollout.protocol import EngineError, Sample, SamplingParams


def user_cache_dir() -> Path:
    """Where vLLM's caches go unless the caller names a directory: $MEGATRON_RL_CACHE, else
    $XDG_CACHE_HOME/megatron-rl, else ~/.cache/megatron-rl.

    Shared by all runs on purpose: on every start vLLM inspects the model class in a fresh
    subprocess (a second import of torch and vLLM, 8-15 s on a 2-core machine) unless its
    model-info cache has the entry, which is keyed by the hash of vLLM's model source file and so
    stays valid across runs. A cache inside each run directory made every new run pay it."""
    if os.environ.get("MEGATRON_RL_CACHE"):
        return Path(os.environ["MEGATRON_RL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "megatron-rl"


def vllm_environment(cache_dir: str | Path | None, *, on_cpu: bool, kv_cache_gib: float) -> dict[str, str]:
    """Environment variables vLLM reads at import/start; measured settings for the CPU build.

    `cache_dir` None: `user_cache_dir()`. Existing values win, so a user can override any of them."""
    cache_dir = user_cache_dir() if cache_dir is None else cache_dir
    env = {
        "VLLM_CACHE_ROOT": str(Path(cache_dir) / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(Path(cache_dir) / "inductor"),
        # vLLM logs every request batch and, on each weight push, a warning for layers without
        # weights (rotary caches); our own console line carries what a user needs.
        "VLLM_LOGGING_LEVEL": "ERROR",
    }
    if on_cpu:
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(max(1, int(kv_cache_gib))),
            # vLLM would bind its OpenMP threads to cores the trainer ranks also use.
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            # The cold compile of the logprob kernel costs 10-20 s and changes nothing we read.
            TORCH_COMPILE_DISABLE="1",
        )
    return {key: os.environ.get(key, value) for key, value in env.items()}


# What vLLM returns as a sampled token's logprob. Its default, "raw_logprobs", is of softmax(logits)
# whatever the request's temperature, while the token was drawn from softmax(logits / temperature);
# the trainer trains on the sampling distribution, so the engines must report that one (after
# temperature, and after top-p, which training refuses: config/rl.py). Every engine we start is
# given it: `vllm.LLM(logprobs_mode=...)` colocated, `--logprobs-mode` for servers.
LOGPROBS_MODE = "processed_logprobs"


def check_logprobs_mode(engine: str, mode: str, temperature: float) -> None:
    """Refuse an engine whose logprobs are not those of the distribution it samples from at
    `temperature` (a server started elsewhere without --logprobs-mode)."""
    if mode != LOGPROBS_MODE:
        raise EngineError(
            f"{engine}: the server returns {mode!r} logprobs, which ignore the sampling temperature "
            f"{temperature} (rl.temperature), so the trainer's logprobs of the sampling distribution would "
            f"not match them; start it with --logprobs-mode {LOGPROBS_MODE} (megatron-rl's own servers and "
            f"rollout nodes are)")


def to_vllm_sampling(params: SamplingParams, prompt_index: int):
    from vllm import SamplingParams as VllmSamplingParams

    return VllmSamplingParams(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        max_tokens=params.max_tokens_of(prompt_index),
        stop=list(params.stop) or None,
        stop_token_ids=list(params.stop_token_ids) or None,
        ignore_eos=params.ignore_eos,
        seed=params.prompt_seed(prompt_index),
        logprobs=0,  # the sampled token's own logprob only
    )


def finish_reason(engine: str, reason: Any, *, partial: bool = False) -> str:
    if reason in ("stop", "length") or (partial and reason == "abort"):
        return reason
    raise EngineError(f"{engine}: request ended with finish reason {reason!r} (aborted or failed)")


def samples_from_request_output(engine: str, prompt_index: int, prompt: list[int], output) -> list[Sample]:
    """vLLM RequestOutput -> Samples in sample order (vLLM's `index` field, not arrival order)."""
    completions = sorted(output.outputs, key=lambda completion: completion.index)
    samples = []
    for position, completion in enumerate(completions):
        token_ids = list(completion.token_ids)
        logprobs = [entry[token].logprob for token, entry in zip(token_ids, completion.logprobs or [])]
        samples.append(Sample(
            prompt_index=prompt_index,
            sample_index=position,
            prompt_token_ids=list(prompt),
            response_token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=finish_reason(engine, completion.finish_reason),
        ))
    return samples


def cpu_kernel_args(model_dir: str | Path, dtype: str) -> dict[str, Any]:
    """`vllm.LLM` arguments that keep a CPU engine on kernels that take this model on this CPU
    (runtime/cpu/vllm_kernels.py); refuses a model no CPU engine can run, before it starts."""
    from megatron_rl.runtime.cpu.vllm_kernels import engine_attention_backend, read_engine_config, refuse_unrunnable

    raw = read_engine_config(model_dir)
    refuse_unrunnable(raw, f"{model_dir}/config.json")
    backend = engine_attention_backend(raw, dtype)
    return {"attention_backend": backend} if backend else {}


def cpu_kernel_flags(model_dir: str | Path, dtype: str) -> list[str]:
    """The same as command-line flags of `vllm serve`."""
    return [f"--{key.replace('_', '-')}={value}" for key, value in cpu_kernel_args(model_dir, dtype).items()]
