"""A rank pool job (tests/suite/test_rank_pool.py) that does what Megatron-Core's objects do to
the gloo groups a job makes: keeps them referenced after the job (here in `lingering_groups`,
a module the pool's process keeps imported), then prints the process's OS thread count."""

import os

import torch
import torch.distributed as dist

import lingering_groups

for ranks in ([0, 1], [0], [1], [0, 1]):
    group = dist.new_group(ranks)
    if dist.get_rank() in ranks:
        total = torch.ones(1)
        dist.all_reduce(total, group=group)
        assert total.item() == len(ranks)
    lingering_groups.KEPT.append(group)
print(f"threads {len(os.listdir('/proc/self/task'))}")
