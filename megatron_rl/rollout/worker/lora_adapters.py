"""Inside vLLM's workers: LoRA adapters loaded from memory (the adapter-only push,
rollout/engines/vllm_lora.py).

vLLM loads an adapter from a directory when a request first names it. Here the trainer's
tensors (PEFT names, whole; each worker's LoRA layers keep their tensor-parallel slice) become
a `LoRAModel` directly (`LoRAModel.from_lora_tensors`, what vLLM's directory loader ends in) and
are added to the worker's LoRA manager under a new id, the previous adapter removed first.
Requests then carry a `LoRARequest` with that id, which the worker finds already loaded; its
path is never read.

Measured on vLLM's CPU build (0.32):
- vLLM scales B in place when it packs an adapter (`lora_b *= alpha / r`, LoRAWeights.optimize),
  and `from_lora_tensors` keeps the tensors it is given: they are cloned here, or the trainer's
  own tensors would be scaled (and scaled again on the next use).
- vLLM drops, without a word, an adapter for a module it did not wrap (not among the engine's
  lora_target_modules): the engine then serves the base weights there (logprobs 0.85 off). The
  module names left after packing are checked against the wrapped modules, and such an adapter
  is refused (removed again) with their names.
- A swap takes 1-6 ms for the tiny models; a fresh id per push (with a fresh name, the prefix
  cache's key) is what keeps cached KV of the previous adapter from being served.
"""

from __future__ import annotations

import torch


class LoraAdapterWorker:
    model_runner = None  # provided by the vLLM worker this class is mixed into

    def load_lora_adapter(self, lora_id: int, tensors: dict[str, torch.Tensor], config: dict) -> list[str]:
        """Load `tensors` (PEFT names) as adapter `lora_id`, then remove every adapter loaded before
        (a refused one leaves them as they were).
        Returns the engine modules the adapter sits on (packed names: qkv_proj, gate_up_proj, ...)."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        workers = self.model_runner.lora_manager  # LRUCacheWorkerLoRAManager
        manager = workers._adapter_manager  # noqa: SLF001 - the adapter manager vLLM loads directories into
        helper = PEFTHelper.from_dict(dict(config, vllm_max_position_embeddings=workers.max_position_embeddings))
        helper.validate_legal(workers.lora_config)
        mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
        lora = LoRAModel.from_lora_tensors(
            lora_id, {name: tensor.clone() for name, tensor in tensors.items()}, helper, device="cpu",
            dtype=workers.lora_config.lora_dtype, model_vocab_size=workers.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(manager.model, "lora_skip_prefixes", None))
        previous = [old for old in manager.list_adapters() if old != lora_id]
        manager.remove_adapter(lora_id)
        manager.add_adapter(lora)  # packs q/k/v into qkv_proj and gate/up into gate_up_proj
        dropped = sorted(set(lora.loras) - set(manager.modules))
        if dropped:  # refused; the adapter served until now stays
            manager.remove_adapter(lora_id)
            raise ValueError(f"the pushed adapter holds modules the engine does not adapt (not among its "
                             f"lora_target_modules), which vLLM would ignore: {dropped[:4]}"
                             f"{' ...' if len(dropped) > 4 else ''}")
        manager.activate_adapter(lora_id)
        for old in previous:  # the engine's CPU cache holds two: the new one never evicts itself
            manager.remove_adapter(old)
        return sorted(lora.loras)
