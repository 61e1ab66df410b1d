"""One node of a SLURM job: `srun` starts this once per node; it runs torchrun for the node's ranks.

    python -m megatron_rl.launch.node --nproc-per-node 8 -- --config run/config.yaml [key=value ...]

Rendezvous is static: MASTER_ADDR and MASTER_PORT (exported by the batch script) are the first
node's; the node rank is SLURM_NODEID and the node count SLURM_NNODES.

Signals: the preemption warning (SIGUSR1) must reach the trainer ranks, which checkpoint and exit
on it. torchrun itself would die of SIGUSR1 (it does not handle it), orphaning its workers, so it
is started with SIGUSR1 ignored (the trainer installs its own handler) and every USR1 this process
gets is passed on to torchrun's workers. SIGTERM goes to torchrun, which stops the workers.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

import psutil


def torchrun_command(python: str, nproc_per_node: int, train_args: list[str], environ=os.environ) -> list[str]:
    nnodes = int(environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES") or 1)
    node_rank = int(environ.get("SLURM_NODEID", 0))
    # torchrun's store listens on MASTER_ADDR only (runtime/torchrun.py)
    return [
        python, "-m", "megatron_rl.runtime.torchrun",
        f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--nproc-per-node={nproc_per_node}",
        f"--master-addr={environ.get('MASTER_ADDR', '127.0.0.1')}",
        f"--master-port={environ.get('MASTER_PORT', '29500')}",
        "-m", "megatron_rl.cli", "train", *train_args,
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_rl.launch.node")
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then `megatron-rl train` arguments")
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    command = torchrun_command(sys.executable, args.nproc_per_node, train_args)
    print(f"[megatron-rl] node {os.environ.get('SLURM_NODEID', 0)} ({os.uname().nodename}): {' '.join(command)}",
          flush=True)

    process = subprocess.Popen(command, preexec_fn=lambda: signal.signal(signal.SIGUSR1, signal.SIG_IGN))

    def forward_usr1(signum, frame):
        try:
            workers = psutil.Process(process.pid).children(recursive=False)
        except psutil.NoSuchProcess:
            return
        for worker in workers:
            try:
                worker.send_signal(signal.SIGUSR1)
            except psutil.NoSuchProcess:
                pass

    def forward_term(signum, frame):
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGUSR1, forward_usr1)
    signal.signal(signal.SIGTERM, forward_term)
    signal.signal(signal.SIGINT, forward_term)
    return process.wait() if process.returncode is None else process.returncode


if __name__ == "__main__":
    sys.exit(main())
