"""Multi-turn trajectories that fail: a line per step when some do, a stop when all of them do.

A trajectory fails when its environment raises, hangs past `rollout.env_timeout_s` or breaks its
contract (agents/rollout.py), or when an OpenAI-client agent raises (agents/openai_agent.py); its
whole group is then dropped from training (train/scoring.py). That is right for a flaky tool and
wrong when every trajectory fails: the run trained on nothing for hours and exited 0, with
`agent/failed` in metrics.jsonl the only trace. The rule is the reward functions' one
(reward_failures.py), on the step's generated trajectories (the same on every rank), before the
step trains:

    some failed     one console line: how many of how many, the groups dropped, the first error
    every one did   TrainingStopped with the first error (where it was raised); nothing was trained
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from megatron_rl.errors import TrainingStopped


@dataclass(frozen=True)
class AgentFailures:
    """A step's failed trajectories, over every group it generated (refills included)."""

    failed: int
    trajectories: int
    groups_dropped: int
    groups: int
    first: str | None  # "group 0, trajectory 1: step() raised KeyError: 'x' (at env.py:12)"


def count_failures(groups: Sequence[Sequence]) -> AgentFailures | None:
    """`groups`: the step's generated trajectories (train/experience.Trajectory); None when they
    are single-turn (no `agent` record)."""
    trajectories = sum(t.agent is not None for group in groups for t in group)
    if not trajectories:
        return None
    failed = [[(position, t) for position, t in enumerate(group)
               if t.agent is not None and t.agent["status"] == "failed"] for group in groups]
    first = next((f"group {index}, trajectory {group[0][0]}: {group[0][1].agent['error']}"
                  for index, group in enumerate(failed) if group), None)
    return AgentFailures(failed=sum(map(len, failed)), trajectories=trajectories,
                         groups_dropped=sum(1 for group in failed if group), groups=len(groups), first=first)


def describe_source(rollout) -> str:
    """What runs the trajectories, as the config names it (`rollout`: the RolloutConfig)."""
    if rollout.agent is not None:
        return f"rollout.agent={rollout.agent}"
    if rollout.environment is not None:
        return f"rollout.environment={rollout.environment}"
    return f"the tool environment of rollout.tools={list(rollout.tools)}"


def check_agent_failures(step: int, failures: AgentFailures | None, source: str,
                         notify: Callable[[str], None]) -> None:
    """`failures`: the step's (None: a single-turn run); `source`: describe_source's text."""
    if failures is None or not failures.failed:
        return
    first = f"; first: {failures.first}" if failures.first else ""
    if failures.failed >= failures.trajectories:
        raise TrainingStopped(f"step {step}: all {failures.trajectories} trajectories failed in {source}{first}. "
                              "Nothing was trained on this step; fix the environment (or rollout.env_timeout_s) and "
                              "re-run the same command (it resumes from the last checkpoint).")
    notify(f"step {step}: {failures.failed} of {failures.trajectories} trajectories failed in {source}, their "
           f"{failures.groups_dropped} of {failures.groups} groups dropped from training{first}")
