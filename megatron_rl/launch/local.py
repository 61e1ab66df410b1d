"""`megatron-rl launch local`: the same training job on this machine, under torchrun.

    megatron-rl launch local --nproc-per-node 2 [--config FILE] [--output-dir DIR] [key=value ...]

The layout is checked against the world size first (milliseconds), then torchrun starts
`megatron-rl train` with the same arguments on this node.
"""

from __future__ import annotations

import os
import subprocess
import sys

from megatron_rl.launch.slurm import resolve_config


def torchrun_command(nproc_per_node: int, train_args: list[str], python: str | None = None) -> list[str]:
    return [python or sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc_per_node}", "-m", "megatron_rl.cli", "train", *train_args]


def run_local(config_path: str | None, overrides: list[str], nproc_per_node: int, *, dry_run: bool = False) -> int:
    resolve_config(config_path, overrides, nproc_per_node, disaggregated=False)
    train_args = (["--config", config_path] if config_path else []) + list(overrides)
    command = torchrun_command(nproc_per_node, train_args)
    if dry_run:
        print(" ".join(command))
        return 0
    print(f"[megatron-rl] {' '.join(command)}", flush=True)
    return subprocess.run(command, env=dict(os.environ)).returncode
