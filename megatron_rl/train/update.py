"""The training half of one RL step, as plain functions: the logprob forwards that store old /
reference logprobs on the trajectories, and the optimizer updates over the packed mini-batches.

    experience = pack_step(groups, ...)                                        (experience.py)
    routing.begin_step(experience.packed, experience.minibatches, ...)     (routing_replay.py)
    with routing.old_forward() as trace:
        store_step_logprobs(policy, experience, "old_logprobs", trace,   # "ref_logprobs": KL
                            temperature=config.rl.temperature)
    metrics = run_updates(policy, runtime, experience, LossSettings.for_run(config, recipe),
                          routing, policy_version=..., check=...)

`Trainer.rl_step` (trainer.py) runs them, and benchmarks/step_overhead.py times the very same
functions on a fixed step (`run_update`, one mini-batch at a time), so that its figures measure
the code a run executes rather than a copy of it. Nothing is kept between calls: the policy, the
routing and the step's batches come in as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from megatron_rl.algorithms import Recipe, reduce_metrics
from megatron_rl.config import RunConfig
from megatron_rl.model.packing import PackedBatch
from megatron_rl.train.experience import (
    PackedStep,
    Trajectory,
    kept_masks,
    make_loss_fn,
    response_masks,
    step_normalizer,
    store_logprobs,
)
from megatron_rl.train.routing_replay import RoutingReplay

if TYPE_CHECKING:
    from megatron_rl.model.policy import Policy, StepResult
    from megatron_rl.runtime import Runtime


@dataclass(frozen=True)
class LossSettings:
    """What make_loss_fn needs besides an update's trajectories and normalizer: the same for
    every update of a run."""

    recipe: Recipe
    # One update per rollout: the old policy IS the updated one, so the loss takes the old
    # logprobs from the update's own forward (ratio exactly 1) and no old-logprob pass runs;
    # except with off-policy masks, whose tokens leave the normaliser before the update's first
    # backward, so they are decided from old logprobs computed before it.
    old_from_forward: bool
    use_ref: bool  # KL: the trajectories hold ref_logprobs
    # rl.temperature: the engines sample from softmax(logits / temperature), so the loss's
    # logprobs, ratio, KL and entropy are of that distribution (as the old, reference and
    # engine logprobs are).
    temperature: float
    max_staleness: int = 0  # asynchronous RL: mismatch metrics per token staleness
    max_turns: int = 0  # multi-turn runs: mismatch metrics per model turn
    # rl.teacher: the teacher's weight in each token's advantage (0: no teacher; config/teacher.py)
    distill_coef: float = 0.0

    @classmethod
    def for_run(cls, config: RunConfig, recipe: Recipe) -> LossSettings:
        rollout = config.rollout
        old_from_forward = config.rl.updates_per_rollout == 1 and not recipe.loss.masks_tokens
        return cls(recipe, old_from_forward=old_from_forward, use_ref=recipe.loss.kl_coef > 0,
                   temperature=config.rl.temperature, max_staleness=config.rl.max_staleness,
                   max_turns=rollout.max_turns if rollout.multi_turn else 0,
                   distill_coef=distill_coef_of(config.rl))


def distill_coef_of(rl) -> float:
    """The teacher's weight in the advantage: 0 without rl.teacher, rl.distill_coef (null: 1) with one."""
    if rl.teacher is None:
        return 0.0
    return 1.0 if rl.distill_coef is None else float(rl.distill_coef)


def store_step_logprobs(policy: Policy, experience: PackedStep, attribute: str, routing, *,
                        temperature: float) -> None:
    """One forward over every update's micro-batches; the response logprobs stored on the
    trajectories as `attribute` ("old_logprobs", "ref_logprobs"). `routing`: the RouterTrace
    that RoutingReplay.old_forward / reference_forward yielded (None: the model routes by
    itself). `temperature`: the sampling temperature (LossSettings.temperature), the same the
    updates train at. The logprobs exist on the last pipeline stage only, which is where the
    loss that reads them runs."""
    if not experience.packed:  # no update has data (pack_step)
        return
    outputs = policy.logprobs(experience.micro_batches(), with_entropy=False, routing=routing, temperature=temperature)
    if not policy.is_last_stage:
        return
    for offset, batches, trajectories in experience.updates():
        store_logprobs(outputs[offset: offset + len(batches)], batches, trajectories, attribute)


def store_update_logprobs(policy: Policy, batches: list[PackedBatch], trajectories: list[Trajectory],
                          loss: LossSettings, routing: RoutingReplay, *, offset: int) -> None:
    """DeepSeek-V3.2's sequence mask compares the engine's logprobs with pi_theta, the policy this
    update trains; its logprobs at the update's start go to `Trajectory.update_logprobs`. The
    step's first update (offset 0) starts from the weights the old logprobs were computed with, so
    it takes those; a later one runs a forward of its mini-batch at the current weights, under the
    update's own routing (the routes its training forward will take)."""
    if offset == 0:
        for trajectory in trajectories:
            trajectory.update_logprobs = trajectory.old_logprobs
        return
    with routing.update(offset) as trace:
        outputs = policy.logprobs(batches, with_entropy=False, routing=trace, temperature=loss.temperature)
    if policy.is_last_stage:
        store_logprobs(outputs, batches, trajectories, "update_logprobs")


def run_update(policy: Policy, runtime: Runtime, batches: list[PackedBatch], trajectories: list[Trajectory],
               loss: LossSettings, routing: RoutingReplay, *, offset: int, policy_version: int) -> StepResult:
    """One optimizer update on one mini-batch: its loss normalizer (collective over the DP
    ranks: every rank's share of the mini-batch counts), its loss closure, and Policy.train_step
    under the routing the run's rl.routing_replay asks for. `offset`: the index of the update's
    first micro-batch in the step, where its recorded routes start."""
    recipe = loss.recipe
    if recipe.loss.opsm_delta is not None:
        store_update_logprobs(policy, batches, trajectories, loss, routing, offset=offset)
    masks = response_masks(batches, trajectories, recipe)
    if policy.is_last_stage:  # where the logprobs are, and the only stage whose loss uses the normalizer
        masks = kept_masks(batches, trajectories, recipe, masks)
    normalizer = step_normalizer(masks, recipe, policy.dp_group, runtime.device)
    loss_fn = make_loss_fn(trajectories, recipe, normalizer, old_from_forward=loss.old_from_forward,
                        use_ref=loss.use_ref, policy_version=policy_version, max_staleness=loss.max_staleness,
                        max_turns=loss.max_turns, distill_coef=loss.distill_coef)
    with routing.update(offset) as trace:
        return policy.train_step(batches, loss_fn, routing=trace, temperature=loss.temperature)


def run_updates(policy: Policy, runtime: Runtime, experience: PackedStep, loss: LossSettings,
                routing: RoutingReplay, *, policy_version: int, check: Callable[[int, StepResult], None]) -> dict:
    """The step's optimizer updates, one per mini-batch, and their metrics: the loss's terms
    reduced over DP on the last stage and brought to the driver, the updates' totals, the routing
    drift (collective under R3). `policy_version`: the version the updates start from (the
    staleness of an asynchronous sample's tokens is measured against it). `check(update,
    result)` sees each update's result before the next runs (the trainer's UpdateGuard, which
    raises to stop the run before a bad update reaches a checkpoint or an engine).

    The updates pack_step left out (no data on any rank) take no optimizer step, but count on
    the learning-rate schedule: the rate at step k is the schedule's, whatever earlier steps kept.
    `train/updates` counts the updates taken; with none, `train/grad_norm` is 0 and the loss's
    terms are absent (count/sequences and count/tokens 0)."""
    results, micro_metrics = [], []
    for update, (offset, batches, trajectories) in enumerate(experience.updates()):
        result = run_update(policy, runtime, batches, trajectories, loss, routing, offset=offset,
                            policy_version=policy_version)
        check(update, result)
        results.append(result)
        micro_metrics.extend(result.metrics)
    if experience.empty_updates:
        policy.advance_schedule(experience.empty_updates)
    metrics = reduce_metrics(micro_metrics, group=policy.dp_group) if runtime.is_last_stage else {}
    metrics = runtime.from_last_stage(metrics)
    metrics.setdefault("count/sequences", 0.0)
    metrics.setdefault("count/tokens", 0.0)
    metrics.update({"train/loss": sum(r.loss for r in results),
                    "train/grad_norm": results[-1].grad_norm if results else 0.0,
                    "train/lr": policy.learning_rate, "train/updates": len(results),
                    "train/skipped_updates": sum(not r.updated for r in results)})
    metrics.update(routing.drift_metrics())
    return metrics
