"""One RL step's experience: generated groups -> rewards -> advantages -> packed training batches.

The driver (global rank 0) scores what the engine generated; every rank then holds the same
`StepRollout` and takes its own groups (whole groups, balanced by token count over the
data-parallel ranks). Per-sample quantities live on `Trajectory`; per-token tensors are rebuilt
per micro-batch from them, so a mini-batch can be packed once (`pack_step` -> `PackedStep`) and
used for the old-logprob forward and the training forward (update.py runs them).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Iterator

import torch

from megatron_rl.algorithms import (
    Recipe,
    apply_overlong_penalty,
    compute_advantages,
    compute_step_normalizer,
    distillation_advantages,
    distillation_metrics,
    length_bias_metrics,
    off_policy_keep,
    policy_loss,
    segments_to_padded,
    zero_spread_groups,
)
from megatron_rl.model.packing import PackedBatch, pack, pack_by_token_budget
from megatron_rl.train.agent_failures import AgentFailures


@dataclass
class Trajectory:
    group: int  # the prompt group within the step
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]  # the engine's, per response token
    truncated: bool  # ended at the token budget, not by a stop
    reward: float
    advantage: float = 0.0
    old_logprobs: torch.Tensor | None = None  # the policy's before this step's updates
    ref_logprobs: torch.Tensor | None = None  # the reference policy's (KL only)
    # DeepSeek-V3.2's off-policy sequence mask (rl.off_policy.opsm_delta): the logprobs of the
    # policy the current update trains, at the update's start (update.store_update_logprobs).
    update_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None  # on-policy distillation's teacher's (train/teacher.py)
    # R3 (rl.routing_replay: rollout): the engine's MoE routes of every token it ran, int
    # [prompt + response - 1, MoE layers, k] (model/routing.py replays them).
    routed_experts: torch.Tensor | None = None
    # Asynchronous RL (rl.max_staleness >= 1): the policy version that produced each response
    # token (a sequence continued across a weight update holds two). None: every token came
    # from the policy this step starts from (the synchronous loop).
    versions: list[int] | None = None
    # Multi-turn (agents/rollout.py): 1 on the model's tokens, 0 on observation tokens (out of
    # the loss, the token counts, entropy, KL, clip and mismatch metrics). None: all the model's.
    loss_mask: list[int] | None = None
    # Multi-turn: turns, finish (stop | length | max_turns | failed), environment info and time.
    agent: dict | None = None
    # An OpenAI-client agent whose history was rewritten (agents/openai_agent.py): its earlier
    # sequences, which train with this trajectory's advantage (expand_segments).
    segments: list[Trajectory] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Positions after the prompt (model and observation tokens)."""
        return len(self.response_ids)

    @property
    def model_length(self) -> int:
        """The model's own tokens: the response length that overlong shaping and metrics see."""
        return self.length if self.loss_mask is None else sum(self.loss_mask)

    def token_mask(self, mask_truncated: bool) -> torch.Tensor:
        """[length] bool: the response positions the loss scores."""
        if mask_truncated and self.truncated:
            return torch.zeros(self.length, dtype=torch.bool)
        if self.loss_mask is None:
            return torch.ones(self.length, dtype=torch.bool)
        if len(self.loss_mask) != self.length:
            raise ValueError(f"a trajectory has {len(self.loss_mask)} loss-mask entries for {self.length} "
                             f"response tokens")
        return torch.tensor(self.loss_mask, dtype=torch.bool)

    def turn_index(self) -> torch.Tensor:
        """[length] int64: k on the tokens of model turn k (1-based: each run of loss-mask ones is
        one turn), 0 on observation tokens."""
        mask = torch.tensor(self.loss_mask if self.loss_mask is not None else [1] * self.length, dtype=torch.long)
        starts = mask.clone()
        starts[1:] = (mask[1:] == 1) & (mask[:-1] == 0)
        return torch.cumsum(starts, 0) * mask


@dataclass
class StepRollout:
    groups: list[list[Trajectory]]  # kept groups, G trajectories each
    metrics: dict[str, float] = field(default_factory=dict)
    # Multi-turn runs: the failed trajectories among every group generated (train/agent_failures.py).
    agent_failures: AgentFailures | None = None


def group_advantages(groups: list[list[Trajectory]], recipe: Recipe) -> None:
    """Fill `advantage` from the group-relative estimator of the recipe (in place), after the
    recipe's overlong reward shaping (DAPO Eq. 13) when it has one. The logged rewards stay the
    outcome rewards; shaping enters the advantages only."""
    if not groups:
        return
    rewards = torch.tensor([[t.reward for t in group] for group in groups], dtype=torch.float64)
    lengths = torch.tensor([[t.model_length for t in group] for group in groups], dtype=torch.float64)
    if recipe.overlong_max_length is not None:
        rewards = apply_overlong_penalty(rewards, lengths, max_length=recipe.overlong_max_length,
                                         buffer_length=recipe.overlong_buffer_length,
                                         penalty_factor=recipe.overlong_penalty_factor)
    # Only REINFORCE++'s token-weighted baseline uses lengths (the others refuse them).
    extra = {"lengths": lengths} if recipe.advantage_estimator == "reinforce_plus_plus_baseline" else {}
    advantages = compute_advantages(rewards, estimator=recipe.advantage_estimator, std=recipe.advantage_std, **extra)
    for group, row in zip(groups, advantages):
        for trajectory, value in zip(group, row.tolist()):
            trajectory.advantage = value


def expand_segments(groups: list[list[Trajectory]]) -> None:
    """After `group_advantages`: each trajectory's earlier segments join its group as sequences
    of their own with the trajectory's advantage (the group compared trajectories, one reward
    each; every token the agent was served trains). In place; groups may grow beyond G."""
    for group in groups:
        for trajectory in list(group):
            for segment in trajectory.segments:
                segment.group, segment.reward, segment.advantage = trajectory.group, trajectory.reward, trajectory.advantage
                group.append(segment)
            trajectory.segments = []


def rollout_metrics(groups: list[list[Trajectory]], correct_threshold: float = 0.5) -> dict[str, float]:
    """Reward, accuracy, lengths and the length-bias diagnostic of all generated groups, and
    `rollout/zero_std_group_frac`: the fraction of them whose rewards are all equal (zero
    advantage, no learning signal), whether or not dynamic sampling drops them."""
    samples = [t for group in groups for t in group]
    if not samples:
        return {}
    rewards = torch.tensor([[t.reward for t in g] for g in groups], dtype=torch.float64)
    lengths = torch.tensor([[t.model_length for t in g] for g in groups], dtype=torch.float64)
    metrics = {
        "reward/mean": float(rewards.mean()),
        "train/accuracy": float((rewards >= correct_threshold).double().mean()),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_frac": sum(t.truncated for t in samples) / len(samples),
        "rollout/zero_std_group_frac": float(zero_spread_groups(rewards).double().mean()),
    }
    bias = length_bias_metrics(rewards, lengths, correct_threshold=correct_threshold)
    metrics.update({f"length_bias/{key}": value for key, value in bias.items()})
    return metrics


def group_tokens(group: list[Trajectory]) -> int:
    """What a group costs to train on: prompt + response tokens of all its samples."""
    return sum(len(t.prompt_ids) + len(t.response_ids) for t in group)


def balanced_partition(sizes: list[int], parts: int, capacities: list[int] | None = None) -> list[list[int]]:
    """Indices of `sizes` in `parts` lists of near-equal sums (greedy longest-processing-time:
    largest first, each to the part with the smallest sum so far that has room).

    Deterministic (ties: the earlier index first, the lower part first), so every rank computes
    the same partition from the same sizes with no communication. `capacities`: the most items
    per part (None: unbounded; they must add up to at least len(sizes)). Each part lists its
    indices in ascending order."""
    if capacities is None:
        capacities = [len(sizes)] * parts
    if len(capacities) != parts or sum(capacities) < len(sizes):
        raise ValueError(f"{parts} parts with room for {capacities} cannot hold {len(sizes)} items")
    heap = [(0, part) for part in range(parts) if capacities[part] > 0]
    heapq.heapify(heap)
    out: list[list[int]] = [[] for _ in range(parts)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, part = heapq.heappop(heap)
        out[part].append(index)
        if len(out[part]) < capacities[part]:
            heapq.heappush(heap, (load + sizes[index], part))
    return [sorted(part) for part in out]


def my_groups(groups: list[list[Trajectory]], dp_rank: int, dp_size: int) -> list[list[Trajectory]]:
    """This data-parallel rank's groups: whole groups, balanced by token count over the ranks
    (balanced_partition), in their rollout order. Every rank computes the same assignment from
    the same StepRollout. With fewer groups than ranks some ranks get none (pack_minibatch gives
    them a zero-loss filler, so the collectives still line up). Which rank trains on which group
    does not change the update: the loss normalizer counts the whole step (step_normalizer)."""
    return [groups[index] for index in dp_parts(groups, dp_size)[dp_rank]]


def dp_parts(groups: list[list[Trajectory]], dp_size: int) -> list[list[int]]:
    """Every data-parallel rank's group indices (my_groups)."""
    return balanced_partition([group_tokens(group) for group in groups], dp_size)


def minibatches(groups: list[list[Trajectory]], count: int) -> list[list[Trajectory]]:
    """Split this rank's groups into `count` mini-batches of whole groups (some may be empty):
    as many groups in each as round-robin would give (the first len % count get one more), those
    groups chosen to balance the mini-batches' token counts, since every rank steps through its
    mini-batches together."""
    sizes = [group_tokens(group) for group in groups]
    capacities = [len(range(index, len(groups), count)) for index in range(count)]
    return [[t for index in part for t in groups[index]] for part in balanced_partition(sizes, count, capacities)]


def pack_minibatch(trajectories: list[Trajectory], token_budget: int, pad_to_multiple: int) -> list[PackedBatch]:
    """Token-budget micro-batches of whole samples; an empty mini-batch gets one zero-loss filler
    micro-batch, so every rank runs the same collective steps."""
    if not trajectories:
        filler = pack([[0] * pad_to_multiple], [pad_to_multiple], sample_ids=[])
        filler.loss_mask.zero_()
        filler.spans = []
        return [filler]
    sequences = [t.prompt_ids + t.response_ids for t in trajectories]
    return pack_by_token_budget(sequences, [len(t.prompt_ids) for t in trajectories], token_budget, pad_to_multiple)


@dataclass
class PackedStep:
    """This rank's share of one step, packed once for every forward over it: the trajectories of
    each update (mini-batch) and their token-budget micro-batches."""

    minibatches: list[list[Trajectory]]
    packed: list[list[PackedBatch]]  # per update, its micro-batches
    # The step's updates left out because they would have no data on any DP rank (pack_step).
    empty_updates: int = 0

    def updates(self) -> Iterator[tuple[int, list[PackedBatch], list[Trajectory]]]:
        """Per update: the index of its first micro-batch in the step (a forward over the whole
        step records routes and returns outputs in this order), its micro-batches, its trajectories."""
        offset = 0
        for batches, trajectories in zip(self.packed, self.minibatches):
            yield offset, batches, trajectories
            offset += len(batches)

    def micro_batches(self) -> list[PackedBatch]:
        """Every update's micro-batches, in order."""
        return [batch for batches in self.packed for batch in batches]


def pack_step(groups: list[list[Trajectory]], *, dp_rank: int, dp_size: int, updates: int, token_budget: int,
              pad_to_multiple: int) -> PackedStep:
    """This rank's groups (my_groups) in `updates` mini-batches (minibatches), each packed into
    token-budget micro-batches (pack_minibatch), less the mini-batches that would be empty on
    every DP rank: with fewer groups than updates (a step whose filters kept few groups, or none)
    those updates have no data anywhere, and an optimizer step on no gradient is no no-op (Adam's
    momentum and weight decay still move every weight). Every rank computes the same count."""
    parts = dp_parts(groups, dp_size)
    # Mini-batch u of a rank holding n groups has data iff u < n (minibatches' round-robin
    # sizes), so dropping the last updates - with_data leaves every other one as it was.
    with_data = min(updates, max(len(part) for part in parts))
    mine = [groups[index] for index in parts[dp_rank]]  # my_groups, from the partition computed once
    per_update = minibatches(mine, with_data) if with_data else []
    return PackedStep(per_update, [pack_minibatch(t, token_budget, pad_to_multiple) for t in per_update],
                      empty_updates=updates - with_data)


def response_masks(batches: list[PackedBatch], trajectories: list[Trajectory], recipe: Recipe) -> list[torch.Tensor]:
    """Per micro-batch [n, L] bool masks of the scored response tokens (what policy_loss sees)."""
    masks = []
    for batch in batches:
        rows = [trajectories[i] for i in batch.sample_ids]
        width = max((t.length for t in rows), default=0)
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for row, trajectory in enumerate(rows):
            mask[row, : trajectory.length] = trajectory.token_mask(recipe.mask_truncated)
        masks.append(mask)
    return masks


def _padded(values: list[torch.Tensor], width: int, device) -> torch.Tensor:
    out = torch.zeros(len(values), width, dtype=torch.float32, device=device)
    for row, value in enumerate(values):
        out[row, : value.numel()] = value.to(device)
    return out


def _advantages(rows: list[Trajectory], device) -> torch.Tensor:
    return torch.tensor([t.advantage for t in rows], dtype=torch.float32, device=device)


def kept_masks(batches: list[PackedBatch], trajectories: list[Trajectory], recipe: Recipe,
               masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """`masks` (response_masks) less the tokens the off-policy corrections take out of the loss
    (rl.off_policy: IcePop, MIS, DeepSeek-V3.2's sequence mask), decided from the same stored
    tensors the loss reads, so that masked tokens leave the step normaliser. Needs the old (and,
    for the sequence mask, the update-start) logprobs: on the last pipeline stage."""
    if not recipe.loss.masks_tokens:
        return masks
    out = []
    for batch, mask in zip(batches, masks):
        rows = [trajectories[i] for i in batch.sample_ids]
        width = mask.shape[1]
        theta = (_padded([t.update_logprobs for t in rows], width, mask.device)
                 if recipe.loss.opsm_delta is not None else None)
        out.append(off_policy_keep(mask, recipe.loss, old_logprobs=_padded([t.old_logprobs for t in rows], width,
                                                                           mask.device),
                                   rollout_logprobs=_padded([torch.tensor(t.rollout_logprobs) for t in rows], width,
                                                            mask.device),
                                   advantages=_advantages(rows, mask.device), logprobs=theta))
    return out


def step_normalizer(masks: list[torch.Tensor], recipe: Recipe, group, device):
    return compute_step_normalizer([m.to(device) for m in masks], recipe.loss.loss_agg_mode, recipe.loss.l_norm,
                                   group=group, device=device)


def store_logprobs(outputs: list[dict], batches: list[PackedBatch], trajectories: list[Trajectory], attribute: str) -> None:
    """Per-sample response logprobs from a Policy.logprobs() pass, stored on the trajectories."""
    for batch, output in zip(batches, outputs):
        for sample_id, values in zip(batch.sample_ids, batch.response_values(output["logprobs"])):
            setattr(trajectories[sample_id], attribute, values.detach().float().cpu())


def make_loss_fn(trajectories: list[Trajectory], recipe: Recipe, normalizer, *, old_from_forward: bool, use_ref: bool,
                 policy_version: int | None = None, max_staleness: int = 0, max_turns: int = 0,
                 distill_coef: float = 0.0):
    """The micro-batch loss for Policy.train_step: this micro-batch's share of the step loss.

    `distill_coef` > 0 (rl.teacher): each token's advantage is (1 - distill_coef) x the sample's
    advantage + distill_coef x (teacher - old logprob) (algorithms/distill.py), from the
    trajectories' `teacher_logprobs`; the metrics then hold `distill/*`.

    `old_from_forward`: with one update per rollout the old policy IS the current one, so the
    old logprobs are this forward's own, detached (ratio exactly 1, no extra forward pass). Not
    with off-policy masks: `normalizer` must then count `kept_masks`, which need the old logprobs
    before the update (and `Trajectory.update_logprobs` for the sequence mask).

    `max_staleness` >= 1 (asynchronous RL, `policy_version` = the version being updated): the
    metrics also hold, for every staleness d in 0..max_staleness (policy_version minus the
    version that produced a token, `Trajectory.versions`; a trajectory without versions is all
    staleness 0), the train/behaviour mismatch |old - rollout logprob| over the loss's tokens of
    that staleness: `mismatch/staleness_{d}/logp_abs_diff_mean` (their mean, `/sub_tok_sum`) and
    `mismatch/staleness_{d}/tokens` (their count, `/sum`). The keys are the same on every rank
    and micro-batch, as reduce_metrics requires. `old` is the proximal policy (with
    old_from_forward, the forward's own detached logprobs). At 0 the metrics are policy_loss's.

    `max_turns` >= 1 (multi-turn runs): the same mismatch per model turn k in 1..max_turns,
    `mismatch/turn_{k}/logp_abs_diff_mean` and `mismatch/turn_{k}/tokens` (a drift that grows
    with the turn would point at the observations' rendering or the engine's prefix cache)."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    if max_staleness and policy_version is None and any(t.versions is not None for t in trajectories):
        raise ValueError("trajectories carry policy versions but make_loss_fn got no policy_version")

    def staleness(rows: list[Trajectory], width: int) -> torch.Tensor:
        """[n, width] int64 staleness of each response token (0 past a sample's end), on the CPU."""
        out = torch.zeros(len(rows), width, dtype=torch.long)
        for row, trajectory in enumerate(rows):
            if trajectory.versions is None:
                continue
            if len(trajectory.versions) != trajectory.length:
                raise ValueError(f"a trajectory has {len(trajectory.versions)} versions for {trajectory.length} "
                                 f"response tokens")
            lag = policy_version - torch.tensor(trajectory.versions, dtype=torch.long)
            if trajectory.length and not 0 <= int(lag.min()) <= int(lag.max()) <= max_staleness:
                raise ValueError(f"token staleness {lag.tolist()} (policy version {policy_version}) is outside "
                                 f"[0, max_staleness={max_staleness}]")
            out[row, : trajectory.length] = lag
        return out

    def mismatch_by(old, rollout, mask, index, values, name: str) -> dict[str, torch.Tensor]:
        """The train/rollout mismatch over the loss's tokens whose `index` equals each of `values`."""
        diff = (old.detach().double() - rollout.double()).abs()
        valid = mask & torch.isfinite(diff)
        diff = torch.where(valid, diff, torch.zeros((), dtype=diff.dtype, device=diff.device))
        out = {}
        for value in values:
            chosen = valid & (index == value)
            out[f"mismatch/{name}_{value}/tokens/sum"] = chosen.sum().double()
            out[f"mismatch/{name}_{value}/logp_abs_diff_mean/sub_tok_sum"] = (diff * chosen).sum()
        return out

    def turns(rows: list[Trajectory], width: int) -> torch.Tensor:
        out = torch.zeros(len(rows), width, dtype=torch.long)
        for row, trajectory in enumerate(rows):
            out[row, : trajectory.length] = trajectory.turn_index()
        return out

    def loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor | None, batch: PackedBatch):
        segments = batch.response_segments()
        current, _ = segments_to_padded(logprobs, segments)
        rows = [trajectories[i] for i in batch.sample_ids]
        width = current.shape[1] if current.dim() == 2 else 0
        device = logprobs.device
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for row, trajectory in enumerate(rows):
            mask[row, : trajectory.length] = trajectory.token_mask(recipe.mask_truncated)
        mask = mask.to(device)
        old = current.detach() if old_from_forward else _padded([t.old_logprobs for t in rows], width, device)
        rollout = _padded([torch.tensor(t.rollout_logprobs) for t in rows], width, device)
        ref = _padded([t.ref_logprobs for t in rows], width, device) if use_ref else None
        ent = segments_to_padded(entropy, segments)[0] if entropy is not None else None
        theta = (_padded([t.update_logprobs for t in rows], width, device)
                 if recipe.loss.opsm_delta is not None else None)
        advantages = _advantages(rows, device)
        if distill_coef:
            teacher = _padded([t.teacher_logprobs for t in rows], width, device)
            advantages = distillation_advantages(advantages, teacher, old, mask, distill_coef)
        loss, metrics = policy_loss(current, old, advantages, mask, recipe.loss, normalizer=normalizer,
                                    ref_logprobs=ref, rollout_logprobs=rollout, entropy=ent, opsm_logprobs=theta)
        if distill_coef:
            metrics.update(distillation_metrics(teacher, old, mask))
        if max_staleness:
            metrics.update(mismatch_by(old, rollout, mask, staleness(rows, width).to(device), range(max_staleness + 1),
                                       "staleness"))
        if max_turns:
            metrics.update(mismatch_by(old, rollout, mask, turns(rows, width).to(device), range(1, max_turns + 1),
                                       "turn"))
        return loss, metrics

    return loss_fn
