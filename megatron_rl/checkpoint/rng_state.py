"""Every random state a rank's training depends on (Python, NumPy, torch, CUDA and Megatron's
CUDA tracker), as tensors and plain values only, so that a resume reads it with
torch.load(weights_only=True) and no pickled callable in a checkpoint ever runs
(checkpoint/unpickling.py)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng() -> dict[str, Any]:
    """Tensors and plain values only, so that resuming reads it with weights_only=True."""
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),  # (version, tuple of ints, None or float)
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
        from megatron.core import tensor_parallel

        state["megatron_cuda_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        numpy_state = (numpy_state["name"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["position"],
                       numpy_state["has_gauss"], numpy_state["cached_gaussian"])
    np.random.set_state(numpy_state)  # a tuple: written before the plain format (unpickling.py)
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_cuda_tracker"])
