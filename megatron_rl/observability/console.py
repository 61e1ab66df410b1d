"""What reaches the console: our progress lines, not our dependencies' start-up chatter.

    quiet_dependencies()     # first thing in the CLI, before torch is imported; --verbose skips it

A default CPU run used to open with Triton's "not available", c10's NUMA-binding notice, vLLM's
FutureWarnings, Megatron-Core's "Apex is not installed" and RerunStateMachine lines: none of them
actionable, all of them burying the lines a user reads. Each comes through a different channel,
so each is turned down at its own source:

* Python warnings: ignored unless raised from megatron_rl itself (ours stay visible).
* Python logging: the dependencies' loggers at ERROR (torch, Megatron-Core, vLLM, transformers,
  ...); errors still show.
* c10's C++ log (the "[W... utils.cpp]" lines): TORCH_CPP_LOG_LEVEL; torch's own Python loggers
  ("Triton not available"): TORCH_LOGS, because torch resets their levels when it is imported.
  Both are read when torch loads, so this must run before the first torch import.
* vLLM's own log level (VLLM_LOGGING_LEVEL, also set by the rollout engines).

Environment variables a user already set win, so `TORCH_CPP_LOG_LEVEL=INFO megatron-rl train`
still works; `--verbose` leaves everything as the libraries configure it.
"""

from __future__ import annotations

import logging
import os
import warnings

# Loggers of dependencies whose INFO/WARNING output is noise in a training console.
DEPENDENCY_LOGGERS = ("torch", "megatron", "vllm", "transformers", "datasets", "urllib3", "filelock", "wandb")


def quiet_dependencies() -> None:
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_LOGS", "-torch")  # "-": that log at ERROR
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    warnings.simplefilter("ignore")
    warnings.filterwarnings("default", module=r"megatron_rl(\.|$)")
    # Raised by torch when Megatron-Core reads .grad of a non-leaf; it is attributed to the CPU
    # layer's frame because the access passes through its function mode.
    warnings.filterwarnings("ignore", message=r".*\.grad attribute of a Tensor that is not a leaf")
    # Raised by torch.distributed.checkpoint inside Megatron-Core's checkpoint loading, attributed
    # to the CPU layer's frame for the same reason.
    warnings.filterwarnings("ignore", message=r"Please use DTensor instead and we are deprecating ShardedTensor")
    for name in DEPENDENCY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    # Megatron-Core logs through the root logger's handler with basicConfig-style "WARNING:name:"
    # lines; with no handler configured Python's last-resort handler prints WARNING and above.
    logging.getLogger().setLevel(logging.ERROR)
    # Ours stay visible: e.g. the rollout pool's warning that a server died and its requests moved.
    logging.getLogger("megatron_rl").setLevel(logging.WARNING)
