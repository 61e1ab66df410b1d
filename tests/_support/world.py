"""A one-rank torch.distributed world for tests that drive a weight transport in-process (the
transports share the driver's outcome through a broadcast). Use as a fixture:
`from _support.world import world  # noqa: F401`."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from _support.processes import free_port


@pytest.fixture
def world():
    if dist.is_initialized():
        assert dist.get_world_size() == 1
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
