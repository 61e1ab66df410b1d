"""The tensors that make up a model's state: its parameters, plus the buffers that are state.

One kind of buffer is state: an MoE router's expert bias (`router.expert_bias`, HF
`e_score_correction_bias`, DeepSeek-V3 / GLM-4.5). The optimizer never touches it (aux-loss-free
balancing moves it after each step, model.moe_router_bias_update_rate), yet it decides which
experts every token uses. So everything that copies "the model" copies it too: the bridge
(import, export, weight sync), the KL reference (frozen at its starting value) and checkpoints.
Other buffers (rotary tables, token counters) are derived or temporary and are left out.
"""

from __future__ import annotations

import re

import torch

_STATE_BUFFER = re.compile(r"(^|\.)router\.expert_bias$")
# Low-rank adapters (model/lora.py): lora_A / lora_B beside the weight they adapt.
_ADAPTER = re.compile(r"(^|\.)lora_[AB]$")


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (model/lora.py)."""
    return bool(_ADAPTER.search(name))


def model_state(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter, then every state buffer, in a rank-independent order."""
    buffers = [(name, b) for name, b in module.named_buffers() if b is not None and _STATE_BUFFER.search(name)]
    return list(module.named_parameters()) + buffers


def trained_state(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """model_state without the frozen parameters (the base under model.lora): the part of the
    state that can differ from the initial weights. The KL reference and a LoRA checkpoint that
    refers to its base keep only this."""
    return [(name, tensor) for name, tensor in model_state(module)
            if not isinstance(tensor, torch.nn.Parameter) or tensor.requires_grad]
