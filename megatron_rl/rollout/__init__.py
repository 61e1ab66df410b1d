"""Rollout engines behind one protocol, and the trainer side of weight sync.

    engine = VllmColocatedEngine(model_dir)                  # or VllmServerEngine / SglangServerEngine / EnginePool
    groups = engine.generate(prompt_ids, SamplingParams(n=8, max_tokens=512, seed=seed))
    engine.update_weights(hf_weight_stream(policy.module, policy.arch))

Engine modules import their engine's package lazily, so importing this package needs neither
vLLM nor SGLang.
"""

from megatron_rl.rollout.pool import EnginePool
from megatron_rl.rollout.protocol import (
    EngineError,
    EngineTimeout,
    EngineUnavailable,
    RolloutEngine,
    Sample,
    SamplingParams,
)
from megatron_rl.rollout.weight_sync import drain, hf_weight_stream

__all__ = [
    "EngineError", "EnginePool", "EngineTimeout", "EngineUnavailable", "RolloutEngine", "Sample",
    "SamplingParams", "drain", "hf_weight_stream",
]
