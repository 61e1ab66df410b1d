"""Test hook, active only with MEGATRON_RL_TEST_SHM_LOG set (tests/rollout/test_colocated_shared_memory.py
puts this directory on PYTHONPATH): vLLM's CPU shared-memory communicator on every CPU, and a record
of the segments it made, in every process that imports vLLM's CPU communicator (the ranks of a
run, fresh or forked from the tests' pre-imported server, which may have imported it already).

vLLM's CPU communicator (vllm/distributed/device_communicators/cpu_communicator.py) shares memory
between the ranks of a TP / PP group only where its kernel library has the `_C::init_shm_manager`
ops: the AVX-512 builds (`_C`, `_C_AVX512`). On an AVX2-only CPU (`_C_AVX2`) it uses
torch.distributed and makes no segment, and vLLM's AVX-512 libraries die of SIGILL when loaded.
Where the ops are missing this hook defines them: the segments are made as csrc/cpu/shm.cpp makes
them (`shm_open("{name}_{rank}", O_CREAT | O_EXCL | O_RDWR)`, truncated and mapped shared; the
other ranks' opened by name and mapped in `join_shm_manager`) and, like the C++ manager, never
unlinked by vLLM's Python code (its destructor runs only at C exit, which this stand-in has
none of); the collectives go through torch.distributed on the group the communicator was made
for. Everything above the ops is vLLM's own: CpuCommunicator picks `_CPUSHMDistributed`, which
names the group (`make_group_name`, from VLLM_DIST_IDENT) and calls the ops.

    MEGATRON_RL_TEST_SHM_LOG=FILE   one JSON line per group a process made: pid, group, rank,
                                    world, the segment names and `ops` ("vllm" or "stand-in")
"""

import importlib.abc
import importlib.util
import json
import os
import sys

MODULE = "vllm.distributed.device_communicators.cpu_communicator"
_library = None  # the torch.library fragment holding the stand-in ops (kept alive)
_groups: list[dict] = []  # per handle: the group, its segments' mappings
_making: list = []  # the device group of the communicator whose manager is being made


def _stand_in_ops() -> None:
    import errno
    import mmap

    import torch
    import torch.distributed as dist

    global _library

    def init_shm_manager(name: str, group_size: int, rank: int, thread_num: int) -> int:
        size = 64 * 1024 + thread_num * 2 * 2**20  # contexts, then 2 MiB per thread (shm.cpp)
        try:
            fd = os.open(f"/dev/shm/{name}_{rank}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            raise RuntimeError(f"create shm in SHMManager failed. errno: {exc.errno}") from None
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        _groups.append({"name": name, "rank": rank, "world": group_size, "size": size, "maps": {rank: mapping},
                        "group": _making[-1] if _making else None})
        return len(_groups) - 1

    def join_shm_manager(handle: int, name: str) -> str:
        record = _groups[handle]
        for other in range(record["world"]):
            if other != record["rank"]:
                try:
                    fd = os.open(f"/dev/shm/{name}_{other}", os.O_RDWR)
                except OSError as exc:
                    raise RuntimeError(f"open shm in SHMManager failed. errno: {exc.errno or errno.ENOENT}") from None
                try:
                    record["maps"][other] = mmap.mmap(fd, record["size"], mmap.MAP_SHARED)
                finally:
                    os.close(fd)
        return ""

    def shm_allreduce(handle: int, data: torch.Tensor) -> None:
        dist.all_reduce(data, group=_groups[handle]["group"])

    def shm_gather(handle: int, data: torch.Tensor, outputs, dst: int) -> None:
        group = _groups[handle]["group"]
        dst_global = dist.get_global_rank(group, dst) if group is not None else dst
        mine = dist.get_rank(group) == dst
        dist.gather(data, list(outputs) if mine else None, dst=dst_global, group=group)

    def shm_all_gather(handle: int, data: torch.Tensor, output: torch.Tensor) -> None:
        record = _groups[handle]
        parts = [torch.empty_like(data) for _ in range(record["world"])]
        dist.all_gather(parts, data.contiguous(), group=record["group"])
        output.copy_(torch.cat(parts, dim=0).view_as(output))

    library = torch.library.Library("_C", "FRAGMENT")
    library.define("init_shm_manager(str name, int group_size, int rank, int thread_num) -> int")
    library.impl("init_shm_manager", init_shm_manager, "CompositeExplicitAutograd")
    library.define("join_shm_manager(int handle, str name) -> str")
    library.impl("join_shm_manager", join_shm_manager, "CompositeExplicitAutograd")
    library.define("shm_allreduce(int handle, Tensor(a!) data) -> ()")
    library.impl("shm_allreduce", shm_allreduce, "CPU")
    library.define("shm_gather(int handle, Tensor data, Tensor(a!)[]? outputs, int dst) -> ()")
    library.impl("shm_gather", shm_gather, "CPU")
    library.define("shm_all_gather(int handle, Tensor data, Tensor(a!) output) -> ()")
    library.impl("shm_all_gather", shm_all_gather, "CPU")
    _library = library


def _install(module) -> None:
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # what vLLM loads before any op is called (vllm/_custom_ops.py)
    ops = "vllm" if hasattr(torch.ops._C, "init_shm_manager") else "stand-in"
    if ops == "stand-in":
        _stand_in_ops()
    shm = module._CPUSHMDistributed
    original = shm._init_cpu_shm

    def init_cpu_shm(self):
        _making.append(self.communicator.device_group)
        try:
            handle = original(self)
        finally:
            _making.pop()
        world, rank = self.communicator.world_size, self.communicator.rank_in_group
        with open(os.environ["MEGATRON_RL_TEST_SHM_LOG"], "a") as log:
            log.write(json.dumps({"pid": os.getpid(), "group": self.group_name, "rank": rank, "world": world,
                                  "segments": [f"{self.group_name}_{r}" for r in range(world)], "ops": ops}) + "\n")
        return handle

    shm._init_cpu_shm = init_cpu_shm


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)  # find the real spec without coming back here
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _install(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("MEGATRON_RL_TEST_SHM_LOG"):
    if MODULE in sys.modules:  # a process forked from a parent that imported it (tests/_support/zygote.py)
        _install(sys.modules[MODULE])
    else:
        sys.meta_path.insert(0, _AfterImport())
