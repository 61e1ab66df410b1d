"""Rank discovery from torchrun and SLURM environments."""

import pytest

from megatron_rl.errors import ConfigError
from megatron_rl.runtime.distributed import first_slurm_host, read_launch_env


def test_torchrun_env():
    env = read_launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.source) == (
        3, 8, 1, "n1", 1234, "torchrun")


def test_slurm_env_takes_first_node_as_master():
    env = read_launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                           "SLURM_JOB_NODELIST": "gpu[007-008,12]"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.source) == (5, 16, 1, "gpu007", "slurm")


def test_single_process():
    env = read_launch_env({})
    assert (env.rank, env.world_size, env.source) == (0, 1, "single") and env.master_port > 0


@pytest.mark.parametrize("nodelist, first", [("node1", "node1"), ("a[1-3]", "a1"), ("x[09,11],y2", "x09"), ("", None)])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_bad_rank_value_is_named():
    with pytest.raises(ConfigError, match="RANK='x' is not an integer"):
        read_launch_env({"RANK": "x", "WORLD_SIZE": "2"})
