"""One rank of a rank pool (rank_pool.py): started once (forked from the pre-imported server with
torchrun's environment, or by torchrun itself), it runs test worker scripts one after another,
each as `python SCRIPT ARGS...` would, in this same process.

    python -m torch.distributed.run --nproc-per-node=N rank_server.py JOBS_DIR

Job k is JOBS_DIR/k.json ({"script", "argv", "paths"}), written whole (renamed into place) by
the client. Every rank runs it with its stdout and stderr (file descriptors 1 and 2, so native
code's output too) in JOBS_DIR/k.rankR.log, then writes its exit code to JOBS_DIR/k.rankR.done (renamed into place).
JOBS_DIR/stop ends the server.

What a fresh process would have, every job has again: its own sys.argv, sys.path entries,
working directory, seeds (the workers seed through start_runtime), Megatron's parallel state
and its list of routers (cleared after each job). A worker that needs anything else fresh stays
on its own torchrun (tests/model/test_expert_bias.py does: it failed in a pool before the router
list was cleared, and has not been tried in one since). What it does not: a new world. The default process group is made
once and kept: torch cannot make it again reliably over the same rendezvous store (a re-made gloo
world timed out here on its first collective), so a job's `destroy_process_group()` of the
default group is a no-op here.

Nor new subgroups for every job (`GroupReuse`): the k-th `new_group` a job asks for with given
ranks and options is the k-th one an earlier job got with them, made once per pool. Within a job
every call still returns a group of its own, as in a fresh process; across jobs the same gloo
groups serve again. Destroying groups between jobs did not release them: Megatron-Core keeps
references the pool cannot reach, and each left-over gloo group kept its threads, busy polling
sockets whose peer rank had dropped its side (about 35 per resharding job, 590 per rank after 17
jobs, a load of 30-60), so a pool had to be replaced every few jobs, a torchrun and an import of
torch, Megatron-Core and transformers per rank each time.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import json
import os
import runpy
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import torch.distributed as dist


class GroupReuse:
    """`torch.distributed.new_group` for a pool (see the module's docstring): the groups each
    (ranks, backend, timeout, options) key was given, in the order they were made; a job takes
    them in that order and makes one only when it needs more of a key than any job before."""

    def __init__(self, new_group):
        self.new_group, self.signature = new_group, inspect.signature(new_group)
        self.made: dict[tuple, list] = {}
        self.taken: Counter = Counter()

    def __call__(self, *args, **kwargs):
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        ranks = given["ranks"]
        # The description only names the group in logs; everything else decides what it is.
        key = (None if ranks is None else tuple(sorted(ranks)), given["backend"], given["timeout"],
               repr(given["pg_options"]), given["use_local_synchronization"], given["device_id"])
        index = self.taken[key]
        self.taken[key] += 1
        groups = self.made.setdefault(key, [])
        if index == len(groups):
            groups.append(self.new_group(*args, **kwargs))
        return groups[index]

    def kept(self, group) -> bool:
        return any(group is made for groups in self.made.values() for made in groups)

    def next_job(self) -> None:
        self.taken.clear()


def keep_pool_groups(reuse: GroupReuse):
    """Makes `destroy_process_group()` a no-op for the world and for the reused groups (a job's
    own `destroy_process_group()` calls, Megatron's included); returns the real one."""
    destroy = dist.destroy_process_group

    def destroy_other_groups(group=None):
        if group is None or group is dist.group.WORLD or reuse.kept(group):
            return  # the pool's world and groups outlive its jobs
        destroy(group)

    dist.destroy_process_group = destroy_other_groups
    return destroy


def install_group_reuse() -> tuple[GroupReuse, object]:
    """Puts GroupReuse in place of torch's new_group (both names code calls it by: Megatron-Core
    calls torch.distributed.new_group, torch's own helpers the c10d module's)."""
    from torch.distributed import distributed_c10d

    reuse = GroupReuse(distributed_c10d.new_group)
    dist.new_group = distributed_c10d.new_group = reuse
    return reuse, keep_pool_groups(reuse)


def destroy_subgroups(destroy, reuse: GroupReuse) -> None:
    """Every process group but the world and the reused ones (a job's groups made some other way),
    so that none is left alive with its threads."""
    from torch.distributed import distributed_c10d

    for group in list(distributed_c10d._world.pg_map):
        if group is not distributed_c10d.GroupMember.WORLD and not reuse.kept(group):
            destroy(group)


@contextlib.contextmanager
def output_to(path: Path):
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "wb", buffering=0) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def reset_megatron_globals(destroy, reuse: GroupReuse) -> None:
    """Megatron-Core's process-wide state that a job's model leaves behind: the parallel state,
    and the list of routers RouterReplay keeps of every model built (megatron_rl.model.routing
    reads it, so a later job would see routers of a model that no longer runs)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router_replay import RouterReplay

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    RouterReplay.global_router_replay_instances.clear()
    destroy_subgroups(destroy, reuse)
    reuse.next_job()


def run_job(job: dict, log: Path, destroy, reuse: GroupReuse) -> int:
    argv, path, cwd = sys.argv[:], sys.path[:], os.getcwd()
    sys.argv = [job["script"], *job["argv"]]
    sys.path[:0] = [str(Path(job["script"]).parent), *job["paths"]]
    code = 0
    with output_to(log):
        try:
            runpy.run_path(job["script"], run_name="__main__")
        except SystemExit as stop:
            if stop.code not in (None, 0):
                code = stop.code if isinstance(stop.code, int) else 1
                if not isinstance(stop.code, int):
                    print(stop.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 (reported to the test, which fails with the traceback)
            traceback.print_exc()
            code = 1
        finally:
            try:
                reset_megatron_globals(destroy, reuse)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                code = code or 1
            sys.argv, sys.path[:] = argv, path
            os.chdir(cwd)
            gc.collect()
    return code


def main() -> None:
    jobs = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    reuse, destroy = install_group_reuse()
    index = 0
    while not (jobs / "stop").exists():
        job_file = jobs / f"{index}.json"
        if not job_file.exists():
            time.sleep(0.05)
            continue
        code = run_job(json.loads(job_file.read_text()), jobs / f"{index}.rank{rank}.log", destroy, reuse)
        staged = jobs / f"{index}.rank{rank}.done.tmp"
        staged.write_text(str(code))
        staged.rename(jobs / f"{index}.rank{rank}.done")  # whole when the client sees it
        index += 1


if __name__ == "__main__":
    main()
