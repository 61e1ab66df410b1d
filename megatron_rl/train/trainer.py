"""The RL loop: `megatron-rl train`.

    for step in steps:
        rollout   <- collector.take(step): prompts from the sampler, G samples each from the
                     engines, rewards, dynamic sampling (collect.py; async_rollout.py runs it
                     ahead of the trainer when rl.max_staleness >= 1)
        advantages, packed token-budget micro-batches of this rank's groups      (experience.py)
        old / reference logprobs, MoE routes as rl.routing_replay says (update.py, routing_replay.py)
        optimizer updates                                                       (update.py)
        weights   -> rollout engines                                                (sync)
        metrics, held-out evaluation (evaluate.py), checkpoint (checkpoint/manager.py)

Process layout: every rank trains its share (Megatron TP/PP/EP/DP). Rollout goes through one
client (rollout/client.py) that gives every rank the same samples and pushes weights through the
configured transport, wherever the engines run. Rewards are computed on the driver (global rank
0) and broadcast (scoring.py). The trainer asks the runtime, never Megatron, where it stands.

A service a step needs that is gone (every rollout engine dead or failing: RolloutFailed; the
teacher's server: TeacherFailed) stops every rank at the same point with one line, after the
checkpoint of the last finished step is written or named (`_service_stop`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.algorithms.from_config import recipe_for
from megatron_rl.checkpoint.manager import CheckpointManager
from megatron_rl.config import RunConfig, to_dict
from megatron_rl.data import build_sampler, encode_prompt
from megatron_rl.errors import ConfigError, TrainingStopped
from megatron_rl.model.policy import Policy
from megatron_rl.observability.metrics_log import MetricsLog
from megatron_rl.observability.plotting import learning_summary
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.engine_model import load_engine_tokenizer, write_engine_model_dir
from megatron_rl.rollout.pool import RolloutFailed
from megatron_rl.runtime import start_runtime
from megatron_rl.runtime.launch_env import read_launch_env
from megatron_rl.train.agent_failures import check_agent_failures, describe_source
from megatron_rl.train.async_collector import AsyncCollector
from megatron_rl.train.collect import SyncCollector
from megatron_rl.train.eval_sets import TrainingEvals, load_eval_sets
from megatron_rl.train.evaluate import evaluate
from megatron_rl.train.generation import Generation
from megatron_rl.train.experience import PackedStep, expand_segments, group_advantages, pack_step
from megatron_rl.train import run_lock
from megatron_rl.train.preflight import preflight
from megatron_rl.train.reward_failures import check_reward_failures
from megatron_rl.train.routing_replay import RoutingReplay
from megatron_rl.train.scoring import GroupScorer
from megatron_rl.train.stop_signals import StopSignals
from megatron_rl.train.teacher import TeacherFailed, build_teacher, teacher_heldout
from megatron_rl.train.update import LossSettings, run_updates, store_step_logprobs
from megatron_rl.train.update_guard import UpdateGuard
from megatron_rl.train.warm_start import WarmStartStopped, warm_start


@dataclass
class TrainResult:
    steps_done: int
    finished: bool  # False: stopped by a signal after checkpointing
    warm_start_accuracy: float | None
    final_accuracy: float | None
    curve_png: Path | None
    checkpoint: Path | None
    is_driver: bool  # global rank 0: the rank that logs and reports


def train(config: RunConfig) -> TrainResult:
    # The driver holds OUTPUT_DIR/run.lock first (run_lock.py): a second run in the directory is
    # refused before it reads or writes anything there; a single process stops at once, the ranks
    # of a larger world all stop once their process group exists.
    launch = read_launch_env()
    lock = refusal = None
    if launch.rank == 0:
        try:
            lock = run_lock.acquire(config.output_dir, notify=lambda line: print(line, flush=True))
        except ConfigError as exc:
            if launch.world_size == 1:
                raise
            refusal = str(exc)
    try:
        datasets = preflight(config) if refusal is None else None
        # rl.eval's sets, read and checked; `heldout` among them is preflight's held-out dataset, not read again
        eval_sets = load_eval_sets(config, datasets[1]) if refusal is None else None
        runtime = start_runtime(config)
        try:
            refusal = runtime.from_driver(refusal)
            if refusal is not None:
                raise ConfigError(refusal)
            return Trainer(config, runtime, datasets, eval_sets).run()
        finally:
            runtime.shutdown()
    finally:
        if lock is not None:
            lock.release()


class Trainer:
    def __init__(self, config: RunConfig, runtime, datasets, eval_sets=None):
        """`datasets`: the (train, held-out) prompt datasets preflight() read; `eval_sets`: rl.eval's
        sets as load_eval_sets() read them."""
        self.config, self.runtime = config, runtime
        self.out = Path(config.output_dir)
        self.recipe = recipe_for(config.rl, config.response_budget)
        self.loss_settings = LossSettings.for_run(config, self.recipe)
        self.train_set, self.heldout = datasets
        # uniform, or the Olmo 3 success-rate curriculum (data.sampler); it learns from every scored group
        self.sampler = build_sampler(config.data, len(self.train_set), config.rl.prompts_per_step, config.seed)

        self.engine_dir = self.out / "engine_model"
        # Owns OUTPUT_DIR/checkpoints: which checkpoint to continue from, saves, the final export.
        self.checkpoints = CheckpointManager(config, runtime, model_dir=self.engine_dir)
        self.checkpoints.prepare()
        chosen = self.checkpoints.choose()
        updates = config.rl.steps * config.rl.updates_per_rollout
        self.policy = Policy(self.checkpoints.policy_config(chosen), runtime, total_steps=updates)
        self.routing = RoutingReplay.attach(config.rl.routing_replay, self.policy, runtime)
        self.tokenizer = self._prepare_engine_model()
        self.scorer = GroupScorer(config.rewards, self.tokenizer, runtime)
        self.evals = TrainingEvals(config, eval_sets or [], self.tokenizer, runtime)  # rl.eval: pass@k of prompt sets
        self.resumed = self.checkpoints.load(self.policy, chosen)
        if self.resumed is not None:
            self.sampler.load_state_dict(self.resumed.state["sampler"])
        start_step = self.resumed.step if self.resumed else 0
        self.log = MetricsLog(self.out, config.rl.steps, wandb_mode=config.logging.wandb_mode,
                              wandb_project=config.logging.wandb_project, run_name=config.logging.run_name,
                              config=to_dict(config), resume_step=start_step, enabled=runtime.is_driver)
        # Engines start with the first weight sync (see RolloutClient).
        self.rollout = RolloutClient(config, self.engine_dir, master_addr=runtime.launch.master_addr,
                                     local_rank=runtime.launch.local_rank, seed=config.seed)
        self.encode = functools.partial(encode_prompt, self.tokenizer, prompt_format=config.data.prompt_format,
                                        system_prompt=config.data.system_prompt)
        # Records -> samples: one completion per prompt, or multi-turn trajectories (rollout.environment / tools).
        self.generation = Generation.build(config, self.tokenizer, self.engine_dir, runtime, self.rollout, self.encode)
        # The one place the loop depends on rl.max_staleness: which collector feeds it.
        collector = AsyncCollector if config.rl.max_staleness else SyncCollector
        self.collector = collector(config=config, dynamic_sampling=self.recipe.dynamic_sampling,
                                   sampler=self.sampler, train_set=self.train_set, rollout=self.rollout,
                                   generation=self.generation, scorer=self.scorer, runtime=runtime,
                                   notify=self.log.message)
        # On-policy distillation (rl.teacher): the teacher's server or frozen model; None without one.
        # Built after RoutingReplay.attach, which took the student's MoE routers only: a trainer-held
        # teacher's routers always route by themselves.
        self.teacher = build_teacher(config, runtime, notify=self.log.message)
        self.stop_signals = StopSignals()
        self.update_guard = None  # made when RL starts: it measures the weights it starts from

    # ---- the loop ---------------------------------------------------------------------------

    def run(self) -> TrainResult:
        config = self.config
        self.stop_signals.install()
        clean = False
        try:
            try:
                if self.resumed is None:
                    if config.warm_start.steps:
                        try:
                            warm_start(self.policy, self.tokenizer, self.train_set, config, self.runtime, self.log,
                                       stop=functools.partial(self.stop_signals.requested, self.runtime))
                        except WarmStartStopped as stopped:  # on every rank at the same step
                            self.log.message(f"{stopped}; nothing of it is saved (no checkpoint resumes a part of a "
                                             "warm start): the same command starts the run again from the beginning")
                            clean = True
                            return self._result(0, finished=False, checkpoint=None)
                    self.sync_weights()
                    self.log.step(0, {**self.evaluate(), **self.evals.run(0, self.generation, self.scorer),
                                      **self._teacher_heldout(),
                                      "rollout/weights_bytes": self.rollout.last_push_bytes})
                    start = 1
                else:
                    self.sync_weights()
                    start = self.resumed.step + 1
                    self.log.message(f"resumed from {self.resumed.path} at step {start - 1}")
            except RolloutFailed as exc:  # on every rank at once: the weights RL starts from are kept
                done = self.resumed.step if self.resumed is not None else 0
                raise self._service_stop("starting RL", done, self._trainer_state(), exc) from None
            self.update_guard = UpdateGuard(config.rl.max_bad_steps, notify=self.log.message,
                                            weight_norm=self.policy.weight_norm(),
                                            max_norm_growth=config.rl.max_weight_norm_growth)
            self.collector.start(start, self.resumed.state if self.resumed is not None else None)

            last_saved = None
            step = start - 1
            state = self._trainer_state()  # the last finished step's, for a stop before the next one trains
            for step in range(start, config.rl.steps + 1):
                self.trained = step - 1  # rl_step sets it to `step` once the step's updates are done
                try:
                    metrics = self.rl_step(step)
                    self.trained = step
                    if step == config.rl.steps or (config.rl.eval_every and step % config.rl.eval_every == 0):
                        metrics.update(self.evaluate())
                    metrics.update(self.evals.run(step, self.generation, self.scorer))  # rl.eval's steps
                except (TeacherFailed, RolloutFailed) as exc:  # on every rank at once
                    if self.trained == step:  # its weights' push or evaluation failed: the step is kept
                        state = self._trainer_state()
                    raise self._service_stop(f"step {step}", self.trained, state, exc) from None
                self.log.step(step, metrics)
                stop = self.stop_signals.requested(self.runtime)
                state = self._trainer_state()
                for saved in self.checkpoints.after_step(step, state, stop=bool(stop), last=step == config.rl.steps):
                    last_saved = saved.path
                    self._report_save(saved)
                if stop:
                    self.log.message(f"stopped by {stop} after step {step}; checkpoint {last_saved}. "
                                     f"Continue with the same command (checkpoint.resume=auto).")
                    self.checkpoints.record_run_state(step, finished=False)
                    clean = True
                    return self._result(step, finished=False, checkpoint=last_saved)
            if config.checkpoint.export_hf:
                path = self.checkpoints.export_hf(step, self.tokenizer, last_saved)
                self.log.message(f"exported the policy at step {step} as a Hugging Face model: {path}")
            self.checkpoints.record_run_state(step, finished=True)
            clean = True
            return self._result(step, finished=True, checkpoint=last_saved)
        except TrainingStopped:
            # Raised on every rank at the same update (its flags are all-reduced), before this
            # step's save: the save still in flight holds good weights and is published.
            clean = True
            raise
        finally:
            self.checkpoints.close(clean=clean)
            self._shutdown()

    def rl_step(self, step: int) -> dict:
        rl, timings = self.config.rl, {}
        rollout = self.collector.take(step, timings)
        self.rollout.sleep()  # rollout.sleep_level: the engine's memory is the policy's until the push
        metrics = dict(rollout.metrics)
        check_agent_failures(step, rollout.agent_failures, describe_source(self.config.rollout),
                             notify=self.log.message)
        check_reward_failures(step, metrics, self.scorer.first_error, notify=self.log.message)

        tick = time.perf_counter()
        group_advantages(rollout.groups, self.recipe)
        expand_segments(rollout.groups)
        experience = pack_step(rollout.groups, dp_rank=self.runtime.dp_rank, dp_size=self.runtime.dp_size,
                               updates=rl.updates_per_rollout, token_budget=self.config.micro_batch_tokens,
                               pad_to_multiple=self.policy.pad_to_multiple)
        if self.teacher is not None:  # each trajectory's teacher_logprobs (the distillation signal)
            self.teacher.score(rollout.groups, experience)
            timings["time/teacher_s"] = time.perf_counter() - tick
            tick = time.perf_counter()
        # With one update per rollout the old policy IS the updated one: the loss takes its
        # logprobs from the update's own forward (ratio exactly 1, no extra pass).
        recompute_old = not self.loss_settings.old_from_forward
        self.routing.begin_step(experience.packed, experience.minibatches, recompute_old=recompute_old)
        if recompute_old:
            with self.routing.old_forward() as trace:
                store_step_logprobs(self.policy, experience, "old_logprobs", trace,
                                    temperature=self.loss_settings.temperature)
        if self.loss_settings.use_ref:
            # The reference: the policy at the start of RL (restored on resume), swapped in for its forward.
            reference = self.checkpoints.reference_weights()
            with self.routing.reference_forward() as trace, reference.swapped_in(self.policy.module):
                store_step_logprobs(self.policy, experience, "ref_logprobs", trace,
                                    temperature=self.loss_settings.temperature)
        timings["time/logprobs_s"] = time.perf_counter() - tick

        tick = time.perf_counter()
        metrics.update(self._train(experience, step))
        self.trained = step
        timings["time/train_s"] = time.perf_counter() - tick

        tick = time.perf_counter()
        metrics["rollout/weights_loaded"] = self.sync_weights(version=step, timings=timings)  # tensors each engine loaded
        metrics["rollout/weights_bytes"] = self.rollout.last_push_bytes  # what that push carried (docs/lora.md)
        timings["time/sync_s"] = time.perf_counter() - tick - timings.get("time/wait_push_s", 0.0)
        metrics.update(timings)
        metrics["time/step_s"] = sum(timings.values())
        return metrics

    def evaluate(self) -> dict:
        return evaluate(self.heldout, self.config.rl, self.config.seed, self.generation, self.scorer)

    def _teacher_heldout(self) -> dict:
        """The teacher's held-out accuracy, measured once at the start when it is cheap (the
        teacher's own server samples); otherwise one line saying why not."""
        if self.teacher is None:
            return {}
        try:
            metrics, why_not = teacher_heldout(self.teacher, self.config, self.heldout, self.encode, self.scorer,
                                               self.runtime)
        except TeacherFailed as exc:  # on every rank at once; the warm start's weights are kept
            raise self._service_stop("measuring the teacher's held-out accuracy", 0, self._trainer_state(),
                                     exc) from None
        if why_not is not None:
            self.log.message(f"the teacher's held-out accuracy is not measured: {why_not}")
        elif "teacher/accuracy" in metrics:
            self.log.message(f"the teacher's held-out accuracy: {metrics['teacher/accuracy']:.3f}")
        return metrics

    # ---- training ---------------------------------------------------------------------------

    def _train(self, experience: PackedStep, step: int) -> dict:
        """The step's optimizer updates and their metrics (update.py). They start from policy
        version step - 1 (the staleness of an asynchronous sample's tokens is measured against it).
        A non-finite or exploding update stops the run here, before the step's checkpoint and
        weight push (update_guard.py)."""
        return run_updates(self.policy, self.runtime, experience, self.loss_settings, self.routing,
                           policy_version=step - 1, check=functools.partial(self.update_guard.check, step))

    # ---- weights, checkpoints, the end -------------------------------------------------------

    def sync_weights(self, version: int | None = None, timings: dict | None = None) -> int:
        """The policy's weights into every engine; `version`: the policy version they are (the
        step just trained; None: the weights RL starts from). Returns the tensors each engine loaded."""
        self.collector.before_push(version, timings)
        count = self.rollout.sync_weights(self.policy.module, self.policy.arch,
                                          pause_mode=self.collector.pause_mode(version))
        self.collector.after_push(version)
        return count

    def _trainer_state(self) -> dict:
        """What a checkpoint needs besides the policy (read when the save starts)."""
        collector = self.collector.state_dict()  # the sampler's cursor (and, async, the batches ahead)
        return {"sampler": collector.pop("sampler"), "seed": self.config.seed, "config": to_dict(self.config),
                **collector}

    def _service_stop(self, failed: str, done: int, state: dict,
                      error: TeacherFailed | RolloutFailed) -> TrainingStopped:
        """Collective: a service the step needs (the teacher's server, the rollout engines) failed
        in `failed`, before anything trained on what it returned, so the weights are step `done`'s
        (the last finished step). Its checkpoint is kept (written with `state`, the trainer state at
        its end, unless it exists) and the run stops in one line, as a stop signal would have."""
        from megatron_rl.checkpoint.store import checkpoint_name

        for saved in self.checkpoints.close(clean=True):  # a save in flight is published first
            self._report_save(saved)
        path = self.checkpoints.root / checkpoint_name(done)
        if not self.runtime.from_driver(path.is_dir()):
            for saved in self.checkpoints.after_step(done, state, stop=True, last=False):
                self._report_save(saved)
        self.checkpoints.record_run_state(done, finished=False)
        if isinstance(error, TeacherFailed):
            until = " once the teacher serves"
        elif self.config.rollout.mode != "colocated" and self.config.rollout.server_urls:
            until = " once the servers of rollout.server_urls serve"
        else:
            until = ""  # the run starts its engines again
        return TrainingStopped(f"{failed}: {error}. Nothing was trained on it; checkpoint {path} (step {done}). "
                               f"Continue with the same command (checkpoint.resume=auto){until}")

    def _report_save(self, saved) -> None:
        mode = "in the background" if self.config.checkpoint.async_save else "synchronously"
        self.log.message(f"checkpoint {saved.path.name}: {saved.bytes / 2**20:.1f} MiB written {mode} in "
                         f"{saved.write_s:.2f} s (CRC-32 {saved.checksum_s:.2f} s); training waited {saved.blocked_s:.2f} s")

    def _prepare_engine_model(self):
        """The engine's model directory: config, generation config and tokenizer (weights are
        pushed); rollout nodes write theirs with the same function (launch/rollout_node.py)."""
        if self.runtime.is_driver:
            write_engine_model_dir(self.config, self.engine_dir)
        self.runtime.barrier()
        return load_engine_tokenizer(self.engine_dir)

    def _result(self, step: int, finished: bool, checkpoint: Path | None) -> TrainResult:
        start = final = png = None
        if self.runtime.is_driver:
            data = self.config.data
            task = f"synthetic {data.synthetic.task}" if data.train == "synthetic" else Path(data.train).name
            start, final, png = learning_summary(self.out, step, title=f"{self.config.rl.recipe} on {task}")
        return TrainResult(step, finished, start, final, png, checkpoint, self.runtime.is_driver)

    def _shutdown(self) -> None:
        self.collector.close()
        if self.teacher is not None:
            self.teacher.close()
        self.generation.close()
        self.log.close()
        self.scorer.close()
        self.evals.close()
        self.rollout.shutdown()
