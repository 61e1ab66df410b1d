"""The adapter-only push of a LoRA run (`rollout.lora_push: adapters`, rollout/engines/vllm_lora.py).

    push = AdapterPush(config, arch)                  # checks the run's targets (refused by name)
    engine = VllmColocatedEngine(..., lora=push.engine_args)
    ... the base weights once (hf_weight_stream(..., merge_adapters=False)), then at every push:
    tensors = push.tensors(module, arch, dtype)       # every rank: PEFT-named, whole
    engine.update_adapters(tensors, push.adapter_config(tensors))

The base is frozen under model.lora, so the one push of W stays right for the whole run, and each
later push is the adapters alone: for a layer of width h adapted at rank r that is r (h_in + h_out)
numbers against the h_in h_out of its weight (docs/lora.md has the bytes measured per push).
"""

from __future__ import annotations

import torch

from megatron_rl.bridge.peft_export import gathered_adapters, peft_tensors
from megatron_rl.rollout.engines.vllm_lora import adapter_config, check_adapter_push, engine_lora_args


class AdapterPush:
    def __init__(self, config, arch):
        self.lora = config.model.lora
        self.targets = check_adapter_push(config, arch)
        self.engine_args = engine_lora_args(self.targets, self.lora.rank)
        self.base_pushed = False  # the engine's base weights W (pushed once, adapters left out)

    def tensors(self, module, arch, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Every rank (the TP gathers are collective): the adapters with PEFT's names, whole, raw
        (B unscaled: vLLM applies alpha / rank once, from adapter_config)."""
        return {name: tensor.to(dtype) for name, tensor in peft_tensors(gathered_adapters(module, arch), arch).items()}

    def adapter_config(self, tensors: dict[str, torch.Tensor]) -> dict:
        return adapter_config(tensors, self.lora.rank, self.lora.alpha)
