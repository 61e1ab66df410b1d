"""The RL loop: `megatron-rl train`.

    for step in steps:
        prompts   <- sampler (resumable cursor)
        samples   <- rollout engine, G per prompt                     (generate)
        rewards   <- reward functions; drop zero-spread groups and
                     refill from more prompts (dynamic sampling)      (score)
        advantages, old / reference logprobs                          (logprobs)
        optimizer updates on packed token-budget micro-batches        (train)
        weights   -> rollout engine                                   (sync)
        metrics, held-out evaluation, checkpoint

Process layout: every rank trains its share (Megatron TP/PP/EP/DP). Rollout goes through one
client (rollout/client.py) that gives every rank the same samples and pushes weights through the
configured transport, wherever the engines run. Rewards are computed on global rank 0 (the
driver) and broadcast.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.config import ConfigError, RunConfig, to_dict
from megatron_rl.experience import (
    StepRollout,
    Trajectory,
    group_advantages,
    make_loss_fn,
    minibatches,
    my_groups,
    pack_minibatch,
    response_masks,
    rollout_metrics,
    step_normalizer,
    store_logprobs,
)
from megatron_rl.logging import MetricsLog, check_wandb_available
from megatron_rl.rollout import SamplingParams
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.engine_model import write_engine_model_dir
from megatron_rl.rollout.factory import check_engine_installed

CORRECT = 0.5  # a sample counts as correct when its reward reaches this (rule rewards are 0 or 1)


@dataclass
class TrainResult:
    steps_done: int
    finished: bool  # False: stopped by a signal after checkpointing
    warm_start_accuracy: float | None
    final_accuracy: float | None
    curve_png: Path | None
    checkpoint: Path | None
    is_driver: bool  # global rank 0: the rank that logs and reports


# ---------------------------------------------------------------------------------------------
# Before anything expensive: everything that can be checked from the config and the files.
# ---------------------------------------------------------------------------------------------


def preflight(config: RunConfig):
    """Everything checkable before a process group or model exists: fast checks first (no torch),
    then the slower ones (imports, files, reward functions). Returns the (train, held-out) prompt
    datasets it read, so the trainer does not read them a second time."""
    from megatron_rl.preflight import check_layout_and_paths

    check_layout_and_paths(config)
    try:
        config.rl.algorithm()
    except ValueError as exc:
        raise ConfigError(f"rl: {exc}") from None
    from megatron_rl.checkpoint_manager import check_run_directory

    check_run_directory(config)

    from megatron_rl.data import load_datasets
    from megatron_rl.rewards import build_scorer

    check_engine_installed(config)
    check_wandb_available(config.logging.wandb_mode)
    build_scorer(config.rewards).close()  # resolves every reward function now
    datasets = load_datasets(config.data)
    if config.warm_start.steps:
        from megatron_rl.warm_start import check_targets

        check_targets(datasets[0])
    return datasets


# ---------------------------------------------------------------------------------------------


def train(config: RunConfig) -> TrainResult:
    datasets = preflight(config)
    from megatron_rl.platform import start_runtime

    runtime = start_runtime(config)
    try:
        return Trainer(config, runtime, datasets).run()
    finally:
        runtime.shutdown()


class Trainer:
    def __init__(self, config: RunConfig, runtime, datasets):
        """`datasets`: the (train, held-out) prompt datasets preflight() read."""
        from megatron_rl.data import PromptSampler
        from megatron_rl.model.policy import Policy
        from megatron_rl.model.routing import RouterTrace
        from megatron_rl.rewards import build_scorer

        self.config, self.runtime = config, runtime
        self.out = Path(config.output_dir)
        self.is_driver = dist.get_rank() == 0
        self.recipe = config.rl.algorithm()
        self.use_kl = self.recipe.loss.kl_coef > 0
        self.stop_signal: str | None = None

        self.train_set, self.heldout = datasets
        self.sampler = PromptSampler(len(self.train_set), config.rl.prompts_per_step,
                                     seed=config.data.seed if config.data.seed is not None else config.seed,
                                     shuffle=config.data.shuffle)
        updates = config.rl.steps * config.rl.updates_per_rollout
        from megatron_rl.checkpoint_manager import CheckpointManager

        self.engine_dir = self.out / "engine_model"
        # Owns OUTPUT_DIR/checkpoints: which checkpoint to continue from, saves, the final export.
        self.checkpoints = CheckpointManager(config, runtime, model_dir=self.engine_dir)
        self.checkpoints.prepare()
        chosen = self.checkpoints.choose()
        self.policy = Policy(self.checkpoints.policy_config(chosen), runtime, total_steps=updates)
        self.routing = RouterTrace.attach()
        self.tokenizer = self._prepare_engine_model()
        self.scorer = build_scorer(config.rewards) if self.is_driver else None
        self.resumed = self.checkpoints.load(self.policy, chosen)
        if self.resumed is not None:
            self.sampler.load_state_dict(self.resumed.state["sampler"])
        start_step = self.resumed.step if self.resumed else 0
        self.log = MetricsLog(self.out, config.rl.steps, wandb_mode=config.logging.wandb_mode,
                              wandb_project=config.logging.wandb_project, run_name=config.logging.run_name,
                              config=to_dict(config), resume_step=start_step, enabled=self.is_driver)
        # Engines start with the first weight sync (see RolloutClient).
        self.rollout = RolloutClient(config, self.engine_dir, master_addr=runtime.launch.master_addr,
                                     local_rank=runtime.launch.local_rank, seed=config.seed)
        self.reference = None

    # ---- the loop ---------------------------------------------------------------------------

    def run(self) -> TrainResult:
        config = self.config
        self._install_signal_handlers()
        clean = False
        try:
            if self.resumed is None:
                if config.warm_start.steps:
                    from megatron_rl.warm_start import warm_start

                    warm_start(self.policy, self.tokenizer, self.train_set, config, self.runtime, self.log)
                self.sync_weights()
                self.log.step(0, self.evaluate())
                start = 1
            else:
                self.sync_weights()
                start = self.resumed.step + 1
                self.log.message(f"resumed from {self.resumed.path} at step {start - 1}")
            if self.use_kl:
                self.reference = self.checkpoints.reference_weights()

            last_saved = None
            step = start - 1
            for step in range(start, config.rl.steps + 1):
                metrics = self.rl_step(step)
                if step == config.rl.steps or (config.rl.eval_every and step % config.rl.eval_every == 0):
                    metrics.update(self.evaluate())
                self.log.step(step, metrics)
                stop = self._stop_requested()
                for saved in self.checkpoints.after_step(step, self._trainer_state(), stop=bool(stop),
                                                         last=step == config.rl.steps):
                    last_saved = saved.path
                    self._report_save(saved)
                if stop:
                    self.log.message(f"stopped by {stop} after step {step}; checkpoint {last_saved}. "
                                     f"Continue with the same command (checkpoint.resume=auto).")
                    self._write_run_state(step, finished=False)
                    clean = True
                    return self._result(step, finished=False, checkpoint=last_saved)
            if config.checkpoint.export_hf:
                self.export_hf(step, last_saved)
            self._write_run_state(step, finished=True)
            clean = True
            return self._result(step, finished=True, checkpoint=last_saved)
        finally:
            self.checkpoints.close(clean=clean)
            self._shutdown()

    def rl_step(self, step: int) -> dict:
        config, timings = self.config, {}
        rollout = self.collect(step, timings)
        metrics = dict(rollout.metrics)

        tick = time.perf_counter()
        group_advantages(rollout.groups, self.recipe)
        mine = my_groups(rollout.groups, self.runtime.dp_rank, self.runtime.dp_size)
        batches_per_update = minibatches(mine, config.rl.updates_per_rollout)
        packed = [pack_minibatch(t, config.micro_batch_tokens, self.policy.pad_to_multiple) for t in batches_per_update]
        recompute_old = config.rl.updates_per_rollout > 1
        if recompute_old:
            self._old_logprobs(packed, batches_per_update)
        if self.use_kl:
            self._reference_logprobs(packed, batches_per_update)
        timings["time/logprobs_s"] = time.perf_counter() - tick

        tick = time.perf_counter()
        metrics.update(self._train(packed, batches_per_update, old_from_forward=not recompute_old))
        timings["time/train_s"] = time.perf_counter() - tick

        tick = time.perf_counter()
        metrics["rollout/weights_loaded"] = self.sync_weights()  # tensors each engine loaded
        timings["time/sync_s"] = time.perf_counter() - tick
        metrics.update(timings)
        metrics["time/step_s"] = sum(timings.values())
        return metrics

    # ---- generate and score -------------------------------------------------------------------

    def collect(self, step: int, timings: dict) -> StepRollout:
        """G samples for each of prompts_per_step prompts; with dynamic sampling, groups whose rewards
        are all equal (no learning signal) are dropped and refilled from further prompts, at most
        max_refill_rounds extra rounds."""
        rl = self.config.rl
        wanted = rl.prompts_per_step
        kept, generated, rounds, round_metrics = [], [], 0, []
        timings["time/generate_s"] = timings["time/score_s"] = 0.0
        indices = self.sampler.next_batch()
        while True:
            records = self.train_set.select(indices)
            tick = time.perf_counter()
            params = SamplingParams(n=rl.group_size, temperature=rl.temperature, top_p=rl.top_p,
                                    max_tokens=rl.max_response_tokens, seed=_step_seed(self.config.seed, step, rounds),
                                    return_routed_experts=rl.routing_replay == "rollout")
            groups = self.generate([self._encode(r.prompt) for r in records], params)
            timings["time/generate_s"] += time.perf_counter() - tick
            tick = time.perf_counter()
            scored, reward_metrics = self.score(records, groups)
            round_metrics.append((sum(len(g) for g in scored), reward_metrics))
            timings["time/score_s"] += time.perf_counter() - tick
            generated.extend(scored)
            if self.recipe.dynamic_sampling:
                kept.extend(g for g in scored if len({t.reward for t in g}) > 1)
            else:
                kept.extend(scored)
            if len(kept) >= wanted or not self.recipe.dynamic_sampling or rounds >= rl.max_refill_rounds:
                break
            rounds += 1
            indices = self.sampler.take(wanted - len(kept))
        kept = kept[:wanted]
        metrics = _combine_rounds(round_metrics)
        metrics.update(rollout_metrics(generated, CORRECT))
        metrics.update({"rollout/groups_kept": len(kept), "rollout/groups_generated": len(generated),
                        "rollout/refill_rounds": rounds})
        for index, group in enumerate(kept):
            for trajectory in group:
                trajectory.group = index
        return StepRollout(kept, metrics)

    def generate(self, prompts: list[list[int]], params: SamplingParams):
        """The same samples on every rank, wherever the engines run."""
        return self.rollout.generate(prompts, params)

    def score(self, records, groups) -> tuple[list[list[Trajectory]], dict]:
        from megatron_rl.data import prompt_text
        from megatron_rl.rewards import RewardInput

        payload = [None, None]
        if self.is_driver:
            inputs = [RewardInput(prompt=prompt_text(record.prompt),
                                  response=self.tokenizer.decode(sample.response_token_ids, skip_special_tokens=True),
                                  answer=record.answer, metadata=record.metadata)
                      for record, group in zip(records, groups) for sample in group]
            result = self.scorer.score(inputs)
            payload = [list(result.rewards), result.metrics()]
        dist.broadcast_object_list(payload, src=0)
        rewards, metrics = payload
        scored, cursor = [], 0
        for index, group in enumerate(groups):
            trajectories = []
            for sample in group:
                trajectories.append(Trajectory(index, sample.prompt_token_ids, sample.response_token_ids,
                                               sample.logprobs, sample.finish_reason == "length", float(rewards[cursor]),
                                               routed_experts=sample.extras.get("routed_experts")))
                cursor += 1
            scored.append(trajectories)
        return scored, metrics

    def evaluate(self) -> dict:
        """Held-out accuracy: one sample per prompt (greedy by default) scored by the reward functions."""
        if self.heldout is None or len(self.heldout) == 0:
            return {}
        rl = self.config.rl
        records = list(self.heldout)[: rl.eval_prompts or len(self.heldout)]
        params = SamplingParams(n=1, temperature=rl.eval_temperature, max_tokens=rl.max_response_tokens,
                                seed=_step_seed(self.config.seed, -1, 0))
        groups = self.generate([self._encode(r.prompt) for r in records], params)
        scored, _ = self.score(records, groups)
        rewards = torch.tensor([g[0].reward for g in scored], dtype=torch.float64)
        lengths = torch.tensor([g[0].length for g in scored], dtype=torch.float64)
        return {"eval/accuracy": float((rewards >= CORRECT).double().mean()), "eval/reward_mean": float(rewards.mean()),
                "eval/length_mean": float(lengths.mean()), "eval/prompts": len(records)}

    # ---- logprobs and training --------------------------------------------------------------

    def _old_logprobs(self, packed, trajectories) -> None:
        """The policy's logprobs before this step's updates (and, for MoE, its routes). With
        rl.routing_replay=rollout (R3) the forward runs on the rollout engine's routes and counts
        those the policy, holding the engine's weights, would have chosen otherwise.

        With pipeline parallelism they exist on the last stage only, which is where the loss
        that reads them runs."""
        flat = [batch for batches in packed for batch in batches]
        if self.routing is not None and self.config.rl.routing_replay == "rollout":
            self.routing.load_rollout_routes(packed, trajectories, self.policy.module,
                                             self.policy.arch.moe_layer_pattern)
            self.routing.reset_counts("rollout")
            self.routing.start("rollout", counter="rollout")
        elif self.routing is not None:
            self.routing.start("record")
        outputs = self.policy.logprobs(flat, with_entropy=False, routing=self.routing)
        if self.routing is not None:
            self.routing.stop()
        if self.policy.is_last_stage:
            position = 0
            for batches, trajs in zip(packed, trajectories):
                store_logprobs(outputs[position: position + len(batches)], batches, trajs, "old_logprobs")
                position += len(batches)

    def _reference_logprobs(self, packed, trajectories) -> None:
        """The reference policy's logprobs; with rl.routing_replay=rollout (R3) on the rollout
        engine's routes, as every forward of the step."""
        flat = [batch for batches in packed for batch in batches]
        routing = self.routing if self.config.rl.routing_replay == "rollout" else None
        if routing is not None:
            routing.load_rollout_routes(packed, trajectories, self.policy.module, self.policy.arch.moe_layer_pattern)
            routing.start("rollout", counter=None)
        with self.reference.swapped_in(self.policy.module):
            outputs = self.policy.logprobs(flat, with_entropy=False, routing=routing)
        if routing is not None:
            routing.stop()
        if self.policy.is_last_stage:
            position = 0
            for batches, trajs in zip(packed, trajectories):
                store_logprobs(outputs[position: position + len(batches)], batches, trajs, "ref_logprobs")
                position += len(batches)

    def _train(self, packed, trajectories, *, old_from_forward: bool) -> dict:
        from megatron_rl.algorithms import reduce_metrics

        results, micro_metrics = [], []
        offset = 0
        rollout_routes = self.config.rl.routing_replay == "rollout"  # R3: the engine's routes in every update
        if rollout_routes and self.routing is not None:
            self.routing.load_rollout_routes(packed, trajectories, self.policy.module,
                                             self.policy.arch.moe_layer_pattern)
            self.routing.reset_counts()
        for batches, trajs in zip(packed, trajectories):
            normalizer = step_normalizer(response_masks(batches, trajs, self.recipe), self.recipe,
                                         self.policy.dp_group, self.runtime.device)
            loss_fn = make_loss_fn(trajs, self.recipe, normalizer, old_from_forward=old_from_forward,
                                   use_ref=self.use_kl)
            routing = None
            if self.routing is not None and rollout_routes:
                routing = self.routing
                routing.start("rollout", offset=offset)
            elif self.routing is not None and not old_from_forward:
                routing = self.routing
                routing.start("replay" if self.config.rl.routing_replay == "training" else "compare", offset=offset)
            result = self.policy.train_step(batches, loss_fn, routing=routing)
            if routing is not None:
                routing.stop()
            offset += len(batches)
            results.append(result)
            micro_metrics.extend(result.metrics)
        metrics = {}
        if self.policy.is_last_stage:
            metrics = reduce_metrics(micro_metrics, group=self.policy.dp_group)
        metrics = _from_last_stage(metrics, self.policy.is_last_stage)
        metrics.update({"train/loss": sum(r.loss for r in results), "train/grad_norm": results[-1].grad_norm,
                        "train/lr": self.policy.learning_rate, "train/updates": len(results)})
        if rollout_routes:
            # Over all ranks (each routes its own tokens and, with pipeline parallelism, its own
            # layers): the training forwards' own choices against the engine's, and the same at
            # the engine's weights (the old-logprob forward, or the one update's forward).
            none = (0, 0)
            drift = self.routing.counts() if self.routing is not None else none
            at_engine = drift if old_from_forward else (
                self.routing.counts("rollout") if self.routing is not None else none)
            counts = torch.tensor([*drift, *at_engine], dtype=torch.float64, device=self.runtime.device)
            dist.all_reduce(counts)
            if counts[1]:
                metrics["moe/routing_drift"] = float(counts[0] / counts[1])
            if counts[3]:
                metrics["moe/rollout_routing_drift"] = float(counts[2] / counts[3])
        elif self.routing is not None and not old_from_forward:
            changed, total = self.routing.counts()
            if total:
                metrics["moe/routing_drift"] = changed / total
        return metrics

    # ---- weights, checkpoints ----------------------------------------------------------------

    def sync_weights(self) -> int:
        return self.rollout.sync_weights(self.policy.module, self.policy.arch)

    def _trainer_state(self) -> dict:
        """What a checkpoint needs besides the policy (read when the save starts)."""
        return {"sampler": self.sampler.state_dict(), "seed": self.config.seed, "config": to_dict(self.config)}

    def _report_save(self, saved) -> None:
        mode = "in the background" if self.config.checkpoint.async_save else "synchronously"
        self.log.message(f"checkpoint {saved.path.name}: {saved.bytes / 2**20:.1f} MiB written {mode} in "
                         f"{saved.write_s:.2f} s (CRC-32 {saved.checksum_s:.2f} s); training waited {saved.blocked_s:.2f} s")

    def export_hf(self, step: int, checkpoint: Path | None) -> None:
        """The final policy as a Hugging Face model in OUTPUT_DIR/hf_model (checkpoint.export_hf)."""
        rl, data, tokenizer = self.config.rl, self.config.data, self.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        generation = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                      "pad_token_id": pad, "do_sample": rl.temperature > 0, "temperature": rl.temperature,
                      "top_p": rl.top_p, "max_new_tokens": rl.max_response_tokens}
        provenance = {
            "run": str(self.out.resolve()), "checkpoint": str(checkpoint) if checkpoint else None,
            "recipe": rl.recipe, "precision": self.config.model.precision,
            "prompt_format": data.prompt_format, "system_prompt": data.system_prompt,
            "prompt_format_help": ("the prompt text tokenized as it is, with the tokenizer's special tokens"
                                   if data.prompt_format == "raw" else
                                   "tokenizer.apply_chat_template(messages, add_generation_prompt=True), "
                                   "the system prompt first"),
            "eval_temperature": rl.eval_temperature,
        }
        path = self.checkpoints.export_hf(step, generation, provenance)
        self.log.message(f"exported the policy at step {step} as a Hugging Face model: {path}")

    def _prepare_engine_model(self):
        """The engine's model directory: config, generation config and tokenizer (weights are
        pushed); rollout nodes write theirs with the same function (launch/rollout_node.py)."""
        from transformers import AutoTokenizer

        if self.is_driver:
            write_engine_model_dir(self.config, self.engine_dir)
        dist.barrier()
        tokenizer = AutoTokenizer.from_pretrained(self.engine_dir)
        if tokenizer.eos_token_id is None:
            raise ConfigError(f"the tokenizer in {self.engine_dir} has no EOS token; responses could never stop")
        return tokenizer

    # ---- signals ------------------------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        # SLURM sends SIGUSR1 (via --signal) or SIGTERM before preemption: finish the step, checkpoint, exit.
        def handler(signum, frame):
            self.stop_signal = signal.Signals(signum).name

        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, handler)

    def _stop_requested(self) -> str | None:
        flag = torch.tensor(1 if self.stop_signal else 0, device=self.runtime.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # any rank signalled: all stop after this step
        return (self.stop_signal or "a signal on another rank") if int(flag) else None

    def _write_run_state(self, step: int, finished: bool) -> None:
        if self.is_driver:
            (self.out / "run_state.json").write_text(json.dumps({"step": step, "finished": finished}))

    def _result(self, step: int, finished: bool, checkpoint: Path | None) -> TrainResult:
        from megatron_rl.logging import read_metrics

        records = read_metrics(self.out / "metrics.jsonl") if self.is_driver else []
        accuracy = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
        png = None
        if self.is_driver and records:
            from megatron_rl.plotting import plot_learning_curve

            png = plot_learning_curve(self.out / "metrics.jsonl", self.out / "learning_curve.png",
                                      title=f"{self.config.rl.recipe} on {_task_name(self.config)}")
        start = next((a for s, a in accuracy if s == 0), None)
        final = accuracy[-1][1] if accuracy and accuracy[-1][0] == step else None
        return TrainResult(step, finished, start, final, png, checkpoint, self.is_driver)

    def _shutdown(self) -> None:
        self.log.close()
        if self.scorer is not None:
            self.scorer.close()
        self.rollout.shutdown()

    def _encode(self, prompt) -> list[int]:
        from megatron_rl.data import encode_prompt

        return encode_prompt(self.tokenizer, prompt, prompt_format=self.config.data.prompt_format,
                             system_prompt=self.config.data.system_prompt)


def _step_seed(seed: int, step: int, round_: int) -> int:
    """The engine's sampling seed for a step's generate round: a resumed run regenerates the same samples."""
    return (seed * 1_000_003 + step * 101 + round_) & 0x7FFF_FFFF


def _combine_rounds(rounds: list[tuple[int, dict]]) -> dict:
    """The scorer's metrics over all generate rounds of a step: counts add up, means are weighted
    by the number of samples scored in each round."""
    total = sum(count for count, _ in rounds) or 1
    combined: dict[str, float] = {}
    for count, metrics in rounds:
        for key, value in metrics.items():
            weight = count / total if key.endswith("/mean") else 1.0
            combined[key] = combined.get(key, 0.0) + weight * value
    return combined


def _from_last_stage(metrics: dict, is_last_stage: bool) -> dict:
    """Metrics reduced on the last pipeline stage, delivered to global rank 0 (the logger)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return metrics
    source = dist.get_world_size() - 1  # a last-stage rank (Megatron puts the last stage at the end)
    holder = [metrics if dist.get_rank() == source else None]
    dist.broadcast_object_list(holder, src=source)
    return holder[0]


def _task_name(config: RunConfig) -> str:
    return f"synthetic {config.data.synthetic.task}" if config.data.train == "synthetic" else Path(config.data.train).name
