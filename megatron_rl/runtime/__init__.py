"""Processes, devices and parallel state: everything below the model.

`start_runtime(config)` is the one entry point: it picks the device, activates the CPU
compatibility layer only on CPU, starts the process group (gloo on CPU, NCCL on GPU) and
Megatron's parallel state, and seeds every RNG. Imported lazily, so that `launch_env` (rank
and world size from the environment) is usable without importing torch.
"""

__all__ = ["Runtime", "start_runtime"]


def __getattr__(name):
    if name in __all__:
        from megatron_rl.runtime import session

        return getattr(session, name)
    raise AttributeError(f"module 'megatron_rl.runtime' has no attribute {name!r}")
