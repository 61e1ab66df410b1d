"""Megatron <-> Hugging Face weights: the only place that knows HF tensor names and fused layouts.

Used by the conversion tools (tools/convert_*.py, `megatron-rl convert`) and, every RL step,
by weight sync to rollout engines:

    load_hf_weights(module, arch, hf_dir)                  # HF safetensors -> sharded model
    for bucket in export_hf_weights(module, arch): ...     # sharded model -> (hf_name, tensor)
    owned_hf_names(module, arch)                           # what this rank's export yields
    quantize_fp8_blockwise(buckets, arch)                  # FP8 weights + scales (HF FP8 export)
    fp8_rollout_stream(stream, arch)                       # the same, on weight sync's flat stream
"""

from megatron_rl.bridge.export import export_hf_weights, owned_hf_names
from megatron_rl.bridge.fp8_export import (
    fp8_quantization_config, fp8_rollout_stream, quantize_fp8_blockwise, with_quantization_config,
)
from megatron_rl.bridge.importer import CheckpointMismatch, load_hf_weights
from megatron_rl.bridge.mappings import expand, rules_for

__all__ = [
    "CheckpointMismatch", "expand", "export_hf_weights", "fp8_quantization_config", "fp8_rollout_stream",
    "load_hf_weights", "owned_hf_names", "quantize_fp8_blockwise", "rules_for", "with_quantization_config",
]
