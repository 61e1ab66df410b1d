"""A step's multi-turn metrics, from the trajectories the step generated (kept or not).

    agent/turns_mean            model turns per trajectory
    agent/tool_calls_mean       tool calls per trajectory (well-formed or not)
    agent/tool_call_rate        share of trajectories that made at least one call
    agent/tool_errors           calls answered with an error (unknown tool, bad arguments, the tool
                                raised, malformed), summed over the step
    agent/failed                trajectories whose environment failed; agent/failed_groups: groups
                                dropped for it
    agent/env_time_s            environment seconds, summed over trajectories (they run in parallel)
    agent/masked_token_share    observation tokens / all tokens after the prompt
    agent/finish/<reason>       share ending stop | length | max_turns | failed
    agent/info/<key>            an environment's own info numbers, per trajectory
"""

from __future__ import annotations

FINISHES = ("stop", "length", "max_turns", "failed")


def agent_metrics(groups) -> dict[str, float]:
    trajectories = [t for group in groups for t in group if t.agent is not None]
    if not trajectories:
        return {}
    count = len(trajectories)
    info_keys = sorted({key for t in trajectories for key in t.agent["info"]})
    total = sum(t.length for t in trajectories)
    model = sum(t.model_length for t in trajectories)
    calls = [t.agent["info"].get("tool_calls", 0.0) for t in trajectories]
    metrics = {
        "agent/turns_mean": sum(t.agent["turns"] for t in trajectories) / count,
        "agent/tool_calls_mean": sum(calls) / count,
        "agent/tool_call_rate": sum(c > 0 for c in calls) / count,
        "agent/tool_errors": sum(t.agent["info"].get("tool_errors", 0.0) for t in trajectories),
        "agent/failed": float(sum(t.agent["status"] == "failed" for t in trajectories)),
        "agent/failed_groups": float(sum(any(t.agent is not None and t.agent["status"] == "failed" for t in group)
                                         for group in groups)),
        "agent/env_time_s": sum(t.agent["env_time_s"] for t in trajectories),
        "agent/masked_token_share": (total - model) / total if total else 0.0,
    }
    for reason in FINISHES:
        metrics[f"agent/finish/{reason}"] = sum(t.agent["finish"] == reason for t in trajectories) / count
    for key in info_keys:
        metrics[f"agent/info/{key}"] = sum(t.agent["info"].get(key, 0.0) for t in trajectories) / count
    return metrics
