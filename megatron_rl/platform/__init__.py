"""Processes, devices and parallel state: everything below the model.

`start_runtime(config)` is the one entry point: it picks the device, activates the CPU
compatibility layer only on CPU, starts the process group (gloo on CPU, NCCL on GPU) and
Megatron's parallel state, and seeds every RNG.
"""

from megatron_rl.platform.runtime import Runtime, start_runtime

__all__ = ["Runtime", "start_runtime"]
