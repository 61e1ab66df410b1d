"""Repairs of vLLM's CPU build (0.32) that our engines need, each measured and explained where it
is defined: the CPU MoE kernel's weight packing redone after a reload, the CPU rotary kernel
made correct for the 3-D query/key of multi-latent attention, seeded sampling kept working
when a prompt's prefill is split over steps, and the CPU MoE kernel kept when LoRA is on.
Applied only where vLLM's CPU classes exist; elsewhere each is a no-op.
"""

from __future__ import annotations

import torch


def cpu_moe_kernels(model: torch.nn.Module) -> list[tuple[torch.nn.Module, object]]:
    """The (layer, CPU MoE experts kernel) pairs of a CPU build's model; empty on other builds.

    Refuses a model whose expert intermediate size the first load zero-padded for the kernel
    (to the kernel's alignment, 32 on the machines measured: moe_intermediate_size 32 at vLLM
    TP 2 was padded from 16 per rank). Re-deriving that layout from reloaded weights is not
    implemented, and vLLM's own reload then fails half-way on a shape mismatch (measured), with
    layers already overwritten; so this runs before the reload, and names the fix."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # not a CPU build: GPU MoE kernels take updated weights as they are
        return []
    found = []
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        intermediate = experts.moe_config.intermediate_size_per_partition
        padded = experts._padded_intermediate_size(experts.moe_config)
        if padded != intermediate:
            raise RuntimeError(
                f"CPU MoE weight update is not supported when vLLM pads the expert intermediate size "
                f"({intermediate} per tensor-parallel rank, padded to {padded}); use a "
                f"moe_intermediate_size that is a multiple of {experts._intermediate_alignment()} per rank"
            )
        found.append((module, experts))
    return found


def repack_cpu_moe(model: torch.nn.Module) -> int:
    """Redo the CPU MoE kernel's weight packing after an in-place reload (see module docstring)."""
    kernels = cpu_moe_kernels(model)
    if not kernels:
        return 0
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.utils import replace_parameter

    for module, experts in kernels:
        replace_parameter(module, "w13_weight", cpu_prepack_moe_weight(module.w13_weight, experts.isa))
        replace_parameter(module, "w2_weight", cpu_prepack_moe_weight(module.w2_weight, experts.isa))
    return len(kernels)


# ---- in-place weight updates -----------------------------------------------------------------



def fix_cpu_rotary_embedding() -> bool:
    """Make vLLM's CPU rotary-embedding kernel correct for 3-D `[tokens, heads, head_size]` inputs.

    Measured on vLLM's CPU build (0.32): `torch.ops._C.rotary_embedding` is right for 2-D
    `[tokens, heads * head_size]` query/key (strided row views included) but not for 3-D ones: a
    contiguous `[7, 3, 64]` query came back off by up to 4.5 in every head, and a `[7, 1, 64]`
    key viewed out of a wider row (stride 576) was left unrotated while the kernel wrote into
    the neighbouring columns. vLLM's multi-latent attention (DeepSeek-V2/V3, Kimi-K2) hands
    exactly such views to `RotaryEmbedding` (q's rotary half per head, k_pe out of the
    kv_a_proj output). With plain RoPE a tiny DeepseekV3ForCausalLM served logprobs off by
    0.1-0.3 from transformers' from the very first load (position 0 exact, every later one
    wrong), with no error; after this fix they agree to ~1e-6. (YaRN RoPE, which the published
    DeepSeek checkpoints use, is a different class that computes RoPE in PyTorch on CPU.)

    The fix wraps `RotaryEmbedding.forward_cpu` at class level: 3-D inputs are flattened into
    2-D copies, rotated by the same kernel, and written back in place, so callers that rely on
    the in-place update and callers that use the returned tensors both see the right values.
    Must run before the model is built (vLLM binds the forward method at construction).
    Idempotent; returns False where there is nothing to fix (not a vLLM build with this class)."""
    try:
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    except ImportError:
        return False
    original = RotaryEmbedding.forward_cpu
    if getattr(original, "_flattens_3d_inputs", False):
        return True

    def forward_cpu(self, positions, query, key=None):
        if query.dim() <= 2 and (key is None or key.dim() <= 2):
            return original(self, positions, query, key)
        tokens = positions.numel()
        flat_query = query.reshape(tokens, -1).clone()
        flat_key = None if key is None else key.reshape(tokens, -1).clone()
        rotated_query, rotated_key = original(self, positions, flat_query, flat_key)
        query.copy_(rotated_query.view_as(query))
        if key is not None:
            key.copy_(rotated_key.view_as(key))
        return query, key

    forward_cpu._flattens_3d_inputs = True
    forward_cpu.__doc__ = original.__doc__
    RotaryEmbedding.forward_cpu = forward_cpu
    return True


def fix_cpu_moe_kernel_with_lora() -> bool:
    """Keep the CPU MoE kernel in an engine started with LoRA (enable_lora) whose experts are no
    LoRA target.

    Measured on vLLM's CPU build (0.32): with any LoRA config, `select_unquantized_moe_backend`
    (fused_moe/oracle/unquantized.py) picks the Triton kernel for every MoE layer, whether or not
    the experts are adapted (fused_moe/layer.py passes is_lora_enabled = "a LoRA config exists"),
    and a Qwen3-MoE engine dies on its first forward ("triton.language has no attribute
    float32"). The fix makes that one choice as if LoRA were off, so the CPU kernel runs the
    experts; attention adapters are unaffected (engine logprobs within 1.4e-6 of the merged
    model's in fp32). Expert adapters stay impossible on CPU (CPUUnquantizedExperts does not
    support LoRA), so the adapter push refuses the experts target (rollout/engines/vllm_lora.py).
    Must run before the model is built. Idempotent; False where there is nothing to fix."""
    try:
        import dataclasses

        from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as method
    except ImportError:
        return False
    original = method.select_unquantized_moe_backend
    if getattr(original, "_ignores_lora", False):
        return True

    def select_unquantized_moe_backend(moe_config):
        return original(dataclasses.replace(moe_config, is_lora_enabled=False))

    select_unquantized_moe_backend._ignores_lora = True
    method.select_unquantized_moe_backend = select_unquantized_moe_backend
    return True


def fix_cpu_seeded_chunked_prefill() -> bool:
    """Keep seeded requests working on CPU when a long prompt's prefill is split over steps.

    Measured on vLLM's CPU build (0.32): a step that prefills only part of a prompt still samples
    a token for it, then discards it and "rewinds" the request's seeded generator with
    `gen.set_offset(gen.get_offset() - 4)` (GPUModelRunner._bookkeeping_sync). That is the CUDA
    Philox generator's API; a CPU generator raises "CPU Generator does not use offset", and the
    engine dies. Any seeded request whose prompt is cut by the step's token budget hits it: the
    multi-turn rollouts' prompts (a tool schema in the system prompt, ~800 tokens, 128 at once)
    did on their first turn.

    The fix does what the rewind means, with the CPU generator's own API: the state of each such
    request's generator is saved before the step samples (`_sample`) and restored after the
    bookkeeping, which skips those generators (they are out of the batch's table meanwhile). So
    a seeded request samples the same tokens whether or not its prefill was split. Idempotent;
    returns False where there is nothing to fix."""
    try:
        import numpy as np
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    if getattr(GPUModelRunner._bookkeeping_sync, "_restores_cpu_generators", False):
        return True
    original_sample, original_bookkeeping = GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync

    def discarded_cpu_generators(runner) -> dict[int, torch.Generator]:
        rows = np.nonzero(runner.discard_request_mask.np[: runner.input_batch.num_reqs])[0]
        generators = runner.input_batch.generators
        return {int(row): generators[int(row)] for row in rows
                if int(row) in generators and generators[int(row)].device.type == "cpu"}

    def _sample(self, *args, **kwargs):
        self._saved_generator_states = {row: gen.get_state() for row, gen in discarded_cpu_generators(self).items()}
        return original_sample(self, *args, **kwargs)

    def _bookkeeping_sync(self, *args, **kwargs):
        saved = getattr(self, "_saved_generator_states", None) or {}
        self._saved_generator_states = None
        held = {row: self.input_batch.generators.pop(row) for row in saved if row in self.input_batch.generators}
        try:
            return original_bookkeeping(self, *args, **kwargs)
        finally:
            for row, generator in held.items():
                generator.set_state(saved[row])
                self.input_batch.generators[row] = generator

    _bookkeeping_sync._restores_cpu_generators = True
    GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync = _sample, _bookkeeping_sync
    return True
