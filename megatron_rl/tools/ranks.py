"""What the multi-rank tools (`megatron-rl convert`, `megatron-rl verify-hf`) share: the layout
arguments, the config a Hugging Face model is built from, re-launching under torchrun with the
stop signals forwarded to every rank, and the model of this rank."""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
from contextlib import contextmanager

from megatron_rl.checkpoint.atomic_dir import stop_signals_handled
from megatron_rl.config import RunConfig, load_config
from megatron_rl.model.hf_config import load_hf_config, parse_hf_config


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM during a conversion. It unwinds like Ctrl-C, so the AtomicDirectory
    removes its staging directory; by default SIGTERM would end the process on the spot."""

    def __init__(self, number: int, reported: bool = False):
        super().__init__(signal.Signals(number).name)
        self.number = number
        self.reported = reported  # the ranks said so already

    def __reduce__(self):  # torch.distributed.checkpoint gathers every rank's error, pickled
        return type(self), (self.number, self.reported)


def layout_args(parser: argparse.ArgumentParser) -> None:
    for name in ("tp", "pp", "ep"):
        parser.add_argument(f"--{name}", type=int, default=1)
    parser.add_argument("--etp", type=int, default=None, help="expert tensor parallel (default: same as --tp)")
    stage_args(parser)
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")


def stage_args(parser: argparse.ArgumentParser) -> None:
    """Uneven pipeline stages, for layer counts --pp does not divide (DeepSeek-V3's 61 layers)."""
    parser.add_argument("--pp-first-stage-layers", type=int, default=None,
                        help="layers on the first pipeline stage (the others split the rest evenly)")
    parser.add_argument("--pp-last-stage-layers", type=int, default=None, help="layers on the last pipeline stage")


def hf_model_config(hf_config: str, args, precision: str, extra: list[str] = ()) -> RunConfig:
    overrides = [
        "device=cpu", f"model.hf_config={hf_config}", f"model.precision={precision}",
        f"parallel.tp={args.tp}", f"parallel.pp={args.pp}", f"parallel.ep={args.ep}",
        # The distributed optimizer is irrelevant here (no optimizer is built).
        *([f"parallel.etp={args.etp}"] if args.etp is not None else []),
        *(f"parallel.{key}={getattr(args, key)}" for key in ("pp_first_stage_layers", "pp_last_stage_layers")
          if getattr(args, key, None) is not None),
        *extra,
    ]
    return load_config(None, overrides)


def world_size_for(config: RunConfig) -> int:
    """Smallest world that fits both the dense (tp*pp) and the expert (etp*ep*pp) layouts."""
    p = config.parallel
    return math.lcm(p.tp * p.pp * p.cp, p.expert_tp * p.ep * p.pp)


def validate_layout(config: RunConfig) -> None:
    from megatron_rl.model.layout_checks import check_divisibility  # layout vs model, no processes needed

    arch = parse_hf_config(*load_hf_config(config.model.hf_config))
    config.parallel.validate_for_model("layout", num_experts=arch.num_experts)
    check_divisibility(arch, config)


def torchrun(world: int, module: str, argv: list[str], env: dict[str, str] | None = None) -> int:
    """`python -m module *argv` on `world` local ranks under torchrun (also `megatron-rl verify-hf`);
    its exit code. `env`: extra environment variables for the ranks. One thread per rank unless
    OMP_NUM_THREADS says otherwise: the ranks share this machine's cores."""
    from megatron_rl.runtime import torchrun as bound_torchrun
    from megatron_rl.runtime.distributed import free_port

    # its rendezvous store on loopback only (runtime/torchrun.py)
    command = bound_torchrun.command(sys.executable, f"--nproc-per-node={world}", "--master-addr=127.0.0.1",
                                     f"--master-port={free_port()}", "-m", module, *argv)
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    return run_ranks(command, dict(os.environ, OMP_NUM_THREADS=threads, **(env or {})))


def run_ranks(command: list[str], env: dict[str, str]) -> int:
    """Run torchrun and wait for it, forwarding SIGINT/SIGTERM to it.

    Killed alone, this process would orphan the ranks, which would then finish and publish the
    output. torchrun passes the signal to every rank (each removes its staging directory and
    exits) and kills the ranks that have not exited 30 s later. It runs in a session of its own, so
    a terminal's Ctrl-C reaches it only through us, once."""
    received: list[int] = []
    unsent: list[int] = []  # came while torchrun was starting
    child: subprocess.Popen | None = None

    def forward(number, frame):
        received.append(number)
        if child is None:
            unsent.append(number)
        else:
            child.send_signal(number)

    with stop_signals_handled(forward):
        child = subprocess.Popen(command, env=env, start_new_session=True)
        for number in unsent[:1]:
            child.send_signal(number)
        code = child.wait()
    if received:
        raise Interrupted(received[0], reported=code != 0)
    return code


@contextmanager
def signals_raise():
    """SIGINT and SIGTERM raise Interrupted inside the block; a second one ends the process at once."""

    def stop(number, frame):
        for other in (signal.SIGINT, signal.SIGTERM):
            signal.signal(other, signal.SIG_DFL)
        raise Interrupted(number)

    with stop_signals_handled(stop):
        yield


def stop_helper_processes() -> None:
    """End the multiprocessing children still running after an interrupt. Megatron-Core's
    checkpoint writer starts a Manager server (a non-daemon process) whose shutdown is registered
    only once it has started: interrupted before that, the interpreter would wait for it forever
    on exit."""
    import multiprocessing

    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout=5)
        if child.is_alive():
            child.kill()


@contextmanager
def model_on_this_rank(config: RunConfig, *, initialize: bool = True, meta: bool = False):
    """(runtime, built model) for this rank; the runtime is shut down however the block ends.
    `initialize=False`: weights left uninitialized, for a caller that loads every one (build_model);
    `meta=True`: the model on the meta device, for the streamed conversions (bridge/streamed.py)."""
    from megatron_rl.model.builder import build_model
    from megatron_rl.runtime import start_runtime

    runtime = start_runtime(config)
    try:
        yield runtime, build_model(config, runtime.device, initialize=initialize, meta=meta)
    finally:
        runtime.shutdown()
