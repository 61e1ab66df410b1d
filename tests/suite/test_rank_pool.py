"""The suite's rank pools (tests/_support/rank_pool.py) run job after job in the same ranks; a
job's gloo groups must not pile up there. Each gloo group keeps its own threads, and a group
still referenced after its job (as Megatron-Core's objects reference theirs) kept them after
being destroyed: 9 more OS threads per rank per job at TP2 x EP2, busy once the peer side was
gone, until pools had to be replaced every 4 jobs. The pool now hands every job the groups an
earlier job made with the same ranks (rank_server.GroupReuse)."""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("lingering_groups_worker.py")


def test_jobs_that_keep_their_groups_add_no_threads_to_the_pool(rank_pools):
    counts = []
    for _ in range(3):
        result = rank_pools.run(WORKER, 2)
        assert result.returncode == 0, result.stderr[-3000:]
        counts.append([int(n) for n in re.findall(r"^threads (\d+)$", result.stderr, re.MULTILINE)])
    assert all(len(per_rank) == 2 for per_rank in counts), counts
    # The first job made the groups; the others got the same ones back.
    assert counts[1] == counts[2] == counts[0], counts
