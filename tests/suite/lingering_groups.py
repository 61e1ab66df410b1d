"""Where lingering_groups_worker.py keeps its groups: a module stays imported in a pool's process
from job to job, as Megatron-Core's do."""

KEPT: list = []
