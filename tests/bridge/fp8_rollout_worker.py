"""One process (no launcher: a world of one) for tests/bridge/test_fp8_rollout_weights.py.

Builds a small Megatron model from --model (an HF config.json directory), gives its weights
block-to-block differing magnitudes and an all-zero block, and writes to --out:

  streams.pt   {"plain": [(name, tensor)...], "fp8": [(name, tensor)...]}: weight sync's stream
               (rollout.hf_weight_stream at the engine dtype, bfloat16) as it is, and through
               fp8_rollout_stream, in stream order
  hf_fp8/      an FP8 HF checkpoint of the same weights (write_hf_checkpoint(fp8=True))
  vllm.json    how vLLM's Fp8Config reads the engine's quantization_config: block size, activation
               scheme, and which modules it leaves unquantized ({} without vLLM). Here rather than
               in the test process: vLLM's import costs less where Megatron already imported its
               dependencies.

    python fp8_rollout_worker.py --model HF_DIR --out OUT_DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from megatron_rl.checkpoint.atomic_dir import AtomicDirectory
from megatron_rl.bridge import fp8_rollout_stream, with_quantization_config
from megatron_rl.bridge.fp8_export import modules_to_not_convert, quantized_names
from megatron_rl.bridge.hf_checkpoint import write_hf_checkpoint
from megatron_rl.config import load_config
from megatron_rl.model.builder import build_model
from megatron_rl.runtime import start_runtime
from megatron_rl.rollout.weights.stream import hf_weight_stream

ENGINE_DTYPE = torch.bfloat16


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    config = load_config(None, ["device=cpu", f"model.hf_config={args.model}", "rollout.dtype=bfloat16"])
    runtime = start_runtime(config)
    built = build_model(config, runtime.device)
    module, arch = built.module, built.arch
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.dim() == 2 and "linear" in name:
                rows = torch.arange(param.shape[0], dtype=param.dtype)
                # Row blocks 1e-3, 1, 1e3... apart: one scale for a whole weight would flush the
                # quiet blocks to zero or saturate the loud ones.
                param.mul_(torch.tensor(10.0, dtype=param.dtype) ** (3 * ((rows // 128) % 3) - 3)[:, None])
                if param.shape[0] >= 128 and param.shape[1] >= 256:
                    param[:128, 128:256] = 0  # an all-zero block
    out = Path(args.out)
    plain = list(hf_weight_stream(module, arch, destination="all", dtype=ENGINE_DTYPE))
    fp8 = list(fp8_rollout_stream(hf_weight_stream(module, arch, destination="all", dtype=ENGINE_DTYPE), arch))
    torch.save({"plain": plain, "fp8": fp8}, out / "streams.pt")
    with AtomicDirectory(out / "hf_fp8") as staging:
        write_hf_checkpoint(module, arch, built.raw_hf_config, staging, bucket_bytes=1 << 16, dtype=ENGINE_DTYPE,
                            fp8=True)
    (out / "vllm.json").write_text(json.dumps(vllm_reading(built.raw_hf_config, arch)))
    runtime.shutdown()


def vllm_reading(raw: dict, arch) -> dict:
    try:
        from vllm.model_executor.layers.quantization.fp8 import Fp8Config
        from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
    except ImportError:
        return {}
    entry = with_quantization_config(raw, arch, fp8=True)["quantization_config"]
    parsed = Fp8Config.from_config(entry)
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}  # Qwen3-MoE's
    modules = {name.removesuffix(".weight") for name in quantized_names(arch)} | set(modules_to_not_convert(arch))
    # vLLM's fused modules, which it checks shard by shard: attention everywhere, dense MLPs.
    modules |= {f"model.layers.{i}.self_attn.qkv_proj" for i in range(arch.num_layers)}
    modules |= {module.replace(".gate_proj", ".gate_up_proj") for module in modules if module.endswith(".mlp.gate_proj")}
    return {"serialized": parsed.is_checkpoint_fp8_serialized, "activation_scheme": parsed.activation_scheme,
            "weight_block_size": parsed.weight_block_size,
            "skipped": {module: is_layer_skipped(module, parsed.ignored_layers, fused) for module in sorted(modules)}}


if __name__ == "__main__":
    main()
