"""torchrun whose rendezvous store listens on its master address only.

    python -m megatron_rl.runtime.torchrun [torchrun's arguments]

torchrun's rendezvous (static: `--master-addr/--master-port`) hosts a TCP store that every rank
joins; torch listens for it on every interface and has no option to change that. This runs
torchrun with that store bound to `--master-addr` as runtime/rendezvous.py resolves it:
127.0.0.1 for single-host launches (`launch local`, the conversions), the first node's address in
a SLURM job (launch/node.py). The ranks themselves are started exactly as torchrun starts them.
"""

from __future__ import annotations

import sys

from megatron_rl.runtime.rendezvous import bound_stores


def command(python: str, *torchrun_args: str) -> list[str]:
    """The command line that runs torchrun with `torchrun_args` through this module."""
    return [python, "-m", "megatron_rl.runtime.torchrun", *torchrun_args]


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.run import main as torchrun

    with bound_stores():
        torchrun(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
