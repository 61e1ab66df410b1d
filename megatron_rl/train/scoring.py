"""Generated samples -> scored trajectories, and the rules both collectors share.

    scorer = GroupScorer(config.rewards, tokenizer, runtime)
    groups, reward_metrics = scorer.score(records, generated)     # collective: rewards from the driver
    keeps_group(group, recipe.dynamic_sampling)                   # DAPO dynamic sampling's keep rule
    step = assemble_step(kept, generated, reward_rounds, ...)     # the StepRollout a step trains on

Rewards are computed on the driver (global rank 0), the only rank with reward functions, and
broadcast: every rank then holds the same trajectories. The asynchronous producer scores on the
driver alone (`score_on_driver`) and broadcasts whole batches itself.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from megatron_rl.agents.metrics import agent_metrics
from megatron_rl.algorithms import dynamic_sampling_keep
from megatron_rl.data import prompt_text
from megatron_rl.rewards import RewardInput, build_scorer
from megatron_rl.rewards.functions import CORRECT
from megatron_rl.rewards.response_stats import count_responses, finalize_response_stats
from megatron_rl.rollout.protocol import Sample
from megatron_rl.train.agent_failures import count_failures
from megatron_rl.train.experience import StepRollout, Trajectory, rollout_metrics


class GroupScorer:
    def __init__(self, reward_config, tokenizer, runtime):
        self.tokenizer, self.runtime = tokenizer, runtime
        self._scorer = build_scorer(reward_config) if runtime.is_driver else None
        if self._scorer is not None:
            # Reward worker processes (and a code reward's first sandbox) start now, beside the
            # warm start and the engine's start, not in the first scoring (~1.2 s on 2 cores).
            self._scorer.start()
        self.first_error: str | None = None  # the driver's: the latest scoring's first failure, if any
        # The asynchronous producer and the held-out evaluation (the trainer's thread) share it.
        self._lock = threading.Lock()

    def score(self, records, groups: Sequence[Sequence[Sample]]) -> tuple[list[list[Trajectory]], dict]:
        """Collective: the groups as trajectories with rewards (computed on the driver), and the
        scorer's metrics, on every rank. `records[i]`: the dataset record of group i's prompt."""
        rewards, metrics = self.runtime.from_driver(self.score_on_driver(records, groups)
                                                    if self.runtime.is_driver else None)
        return to_trajectories(groups, rewards), metrics

    def score_on_driver(self, records, groups: Sequence[Sequence[Sample]]) -> tuple[list[float], dict]:
        """The driver only: one reward per sample (in sample order) and the scorer's metrics.

        A multi-turn sample whose environment gave a reward keeps it; the others are scored by
        the reward functions on the model's last turn (`final_response_ids`), never on the
        observations. A failed trajectory gets 0 here and its group is dropped (`keeps_group`)."""
        samples = [(record, sample) for record, group in zip(records, groups) for sample in group]
        rewards: list[float | None] = [_environment_reward(sample) for _, sample in samples]
        to_score = [index for index, reward in enumerate(rewards) if reward is None]
        metrics: dict = {}
        texts: dict[int, str] = {}
        if to_score:
            inputs = []
            for index in to_score:
                record, sample = samples[index]
                ids = sample.extras.get("final_response_ids", sample.response_token_ids)
                texts[index] = self.tokenizer.decode(ids, skip_special_tokens=True)
                inputs.append(RewardInput(prompt=prompt_text(record.prompt), response=texts[index],
                                          answer=record.answer, metadata=record.metadata))
            with self._lock:
                result = self._scorer.score(inputs)
                self.first_error = result.first_error or self.first_error
            for index, reward in zip(to_score, result.rewards):
                rewards[index] = reward
            metrics = result.metrics()
        if len(texts) == len(samples):  # single-turn, every sample scored here: what the responses are
            described, cursor = [], 0
            for record, group in zip(records, groups):
                described.append([(record.metadata, texts[cursor + i], rewards[cursor + i],
                                   len(sample.response_token_ids)) for i, sample in enumerate(group)])
                cursor += len(group)
            metrics.update(count_responses(described))
        return [float(r) for r in rewards], metrics

    def score_group_on_driver(self, record, samples: Sequence[Sample]) -> tuple[list[Trajectory], dict]:
        """The driver only: one group's trajectories with rewards, and the scorer's metrics."""
        rewards, metrics = self.score_on_driver([record], [samples])
        return to_trajectories([samples], rewards)[0], metrics

    def close(self) -> None:
        if self._scorer is not None:
            self._scorer.close()


def to_trajectories(groups: Sequence[Sequence[Sample]], rewards: Sequence[float]) -> list[list[Trajectory]]:
    """Samples with their rewards (in sample order) as trajectories; a sample's `versions` (the
    policy version of each token) comes from the asynchronous producer, its `routed_experts`
    from an engine asked for them (R3), its `segments` from an OpenAI-client agent."""
    scored, cursor = [], 0
    for index, group in enumerate(groups):
        trajectories = []
        for sample in group:
            trajectories.append(_trajectory(index, sample, float(rewards[cursor])))
            cursor += 1
        scored.append(trajectories)
    return scored


def _trajectory(group: int, sample: Sample, reward: float) -> Trajectory:
    return Trajectory(group, sample.prompt_token_ids, sample.response_token_ids, sample.logprobs,
                      sample.finish_reason == "length", reward, routed_experts=sample.extras.get("routed_experts"),
                      versions=sample.extras.get("versions"), loss_mask=sample.extras.get("loss_mask"),
                      agent=sample.extras.get("agent"),
                      segments=[_trajectory(group, segment, reward) for segment in sample.extras.get("segments", ())])


def _environment_reward(sample: Sample) -> float | None:
    agent = sample.extras.get("agent")
    if agent is None:
        return None
    if agent["status"] == "failed":
        return 0.0  # never trained on: its group is dropped
    return agent["reward"]


def failed(trajectory: Trajectory) -> bool:
    """A multi-turn trajectory whose environment failed (not a wrong answer)."""
    return trajectory.agent is not None and trajectory.agent["status"] == "failed"


def keeps_group(group: Sequence[Trajectory], dynamic_sampling: bool) -> bool:
    """Whether a step trains on this group: never when one of its trajectories failed (its
    environment broke: comparing the others with it would corrupt the group's advantages); else
    always, or under dynamic sampling (DAPO arXiv:2503.14476 §3.2) only when its rewards differ
    (an all-equal group has zero advantage)."""
    if any(failed(t) for t in group):
        return False
    if not dynamic_sampling:
        return True
    rewards = torch.tensor([[t.reward for t in group]], dtype=torch.float64)
    return bool(dynamic_sampling_keep(rewards)[0])


def combine_rounds(rounds: Sequence[tuple[int, dict]]) -> dict:
    """The scorer's metrics over all scoring rounds of a step (`rounds`: (samples scored, metrics)
    each): counts add up, means are weighted by the number of samples scored in each round."""
    total = sum(count for count, _ in rounds) or 1
    combined: dict[str, float] = {}
    for count, metrics in rounds:
        for key, value in metrics.items():
            weight = count / total if key.endswith("/mean") else 1.0
            combined[key] = combined.get(key, 0.0) + weight * value
    return combined


def assemble_step(kept: list[list[Trajectory]], generated: list[list[Trajectory]],
                  reward_rounds: Sequence[tuple[int, dict]], sampler_metrics: dict, counts: dict) -> StepRollout:
    """What a step trains on: the kept groups, numbered in order, the step's rollout metrics (the
    scorer's, the sampler's, those of every generated group, then the collector's `counts`), and
    its failed multi-turn trajectories."""
    metrics = finalize_response_stats(combine_rounds(reward_rounds))
    metrics.update(sampler_metrics)
    metrics.update(rollout_metrics(generated, CORRECT))
    metrics.update(agent_metrics(generated))
    metrics.update({"rollout/groups_kept": len(kept), "rollout/groups_generated": len(generated), **counts})
    for index, group in enumerate(kept):
        for trajectory in group:
            trajectory.group = index
    return StepRollout(kept, metrics, agent_failures=count_failures(generated))
