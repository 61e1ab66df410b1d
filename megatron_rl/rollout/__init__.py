"""Rollout: engines behind one protocol, weight transports, and the client the trainer holds.

    rollout = RolloutClient(config, model_dir, master_addr=..., local_rank=..., seed=...)  # client.py
    groups = rollout.generate(prompt_ids, SamplingParams(n=8, max_tokens=512, seed=seed))
    rollout.sync_weights(policy.module, policy.arch)

    engine = VllmColocatedEngine(model_dir)    # or VllmServerEngine / SglangServerEngine (protocol.py)
    engine.update_weights(hf_weight_stream(policy.module, policy.arch))   # one engine, by hand

docs/architecture.md draws the layer.
Engine modules import their engine's package lazily, so importing this package needs neither
vLLM nor SGLang.
"""

from megatron_rl.rollout.pool import EnginePool
from megatron_rl.rollout.protocol import (
    EngineDied,
    EngineError,
    EngineTimeout,
    EngineUnavailable,
    RolloutEngine,
    Sample,
    SamplingParams,
)
from megatron_rl.rollout.weights.stream import drain, hf_weight_stream

__all__ = [
    "EngineDied", "EngineError", "EnginePool", "EngineTimeout", "EngineUnavailable", "RolloutEngine", "Sample",
    "SamplingParams", "drain", "hf_weight_stream",
]
