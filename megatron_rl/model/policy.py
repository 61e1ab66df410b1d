"""The trainable policy: a Megatron-Core GPTModel with DDP, the Megatron optimizer and schedule.

Two operations, both over packed micro-batches and any TP/PP/EP/DP layout:

    policy.logprobs(batches)            -> per-position logprobs (and entropy), no grad
    policy.train_step(batches, loss_fn) -> one optimizer step; returns loss and grad norm

Both take `temperature`: the distribution they compute is softmax(logits / temperature), the one
the rollout engines sample from at that temperature (RL passes `rl.temperature`: the ratio, KL,
entropy and gradient are then of the sampling distribution; the supervised warm start keeps 1).

`loss_fn(logprobs, entropy, batch)` returns this micro-batch's share of the step loss, already
divided by a normalizer taken over the WHOLE step (every micro-batch on every DP rank; see
`megatron_rl.algorithms.compute_step_normalizer`). That is
why Megatron is configured with `calculate_per_token_loss=True` and a finalize function without
token scaling: the schedule then neither divides by the number of micro-batches nor averages
gradients over DP, and summing micro-batch gradients gives exactly the full-batch gradient.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from megatron_rl.config import RunConfig
from megatron_rl.model.builder import build_model
from megatron_rl.model.fp8 import micro_batch_multiple
from megatron_rl.model.hf_config import ArchitectureSpec
from megatron_rl.model.logprobs import vocab_parallel_logprobs_entropy
from megatron_rl.model.packing import PackedBatch, pack
from megatron_rl.model.state import is_adapter, trained_state
from megatron_rl.runtime.cpu import megatron_patches as cpu_compat
from megatron_rl.runtime.session import Runtime

LossFn = Callable[[torch.Tensor, torch.Tensor | None, PackedBatch], tuple[torch.Tensor, dict]]


@dataclass
class StepResult:
    loss: float  # the step loss summed over micro-batches and DP ranks
    grad_norm: float  # NaN when the update was skipped for a non-finite gradient
    updated: bool
    # False: the update left a weight non-finite (or a weight norm beyond float32); the same on every rank.
    weights_finite: bool = True
    # After an update: Policy.weight_norm() of the updated weights (inf when they are not finite);
    # NaN when the update was skipped. The learning rate the update ran at.
    weight_norm: float = float("nan")
    lr: float = float("nan")
    # The loss function's metric dicts, one per real micro-batch (last pipeline stage; empty elsewhere).
    metrics: list[dict] = field(default_factory=list)


class Policy:
    def __init__(self, config: RunConfig, runtime: Runtime, total_steps: int = 1):
        """`total_steps`: optimizer steps the run will take (the LR decay horizon by default)."""
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.config = config
        self.runtime = runtime
        built = build_model(config, runtime.device)
        self.raw_hf_config = built.raw_hf_config
        self.arch: ArchitectureSpec = built.arch
        self.use_te = built.use_te
        self.tconfig = built.tconfig
        model = built.module
        self.model = DistributedDataParallel(
            config=self.tconfig,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=config.parallel.distributed_optimizer,
                # Megatron would raise on a NaN gradient (on the ranks that hold it only); the
                # optimizer step checks every rank's gradients instead and skips the update.
                check_for_nan_in_grad=False,
                # FP8 weights (model.fp8_param) are gathered in FP8 after each optimizer step.
                fp8_param_gather=config.model.fp8_param,
            ),
            module=model,
        )
        self.tconfig.finalize_model_grads_func = _finalize_without_token_scaling
        opt = config.optimizer
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=opt.lr,
                min_lr=opt.effective_min_lr,
                weight_decay=opt.weight_decay,
                adam_beta1=opt.adam_beta1,
                adam_beta2=opt.adam_beta2,
                adam_eps=opt.adam_eps,
                clip_grad=opt.clip_grad,
                bf16=config.model.precision == "bf16",
                params_dtype=self.tconfig.params_dtype,
                use_distributed_optimizer=config.parallel.distributed_optimizer,
                # The distributed optimizer re-quantizes FP8 weights per recipe (None without FP8).
                fp8_recipe=self.tconfig.fp8_recipe if self.tconfig.fp8 else None,
            ),
            [self.model],
        )
        self.scheduler = _lr_scheduler(self.optimizer, opt, total_steps=total_steps)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.is_last_stage = parallel_state.is_pipeline_last_stage()
        # Sequence parallelism splits the packed row evenly over TP ranks; FP8 GEMMs also need
        # each rank's rows aligned (16, or 32 for MXFP8).
        self.pad_to_multiple = micro_batch_multiple(
            config.model, config.parallel.tp if config.parallel.uses_sequence_parallel else 1
        )

    @property
    def module(self):
        """The bare GPTModel (for state dicts and checkpoints)."""
        return self.model.module

    # ------------------------------------------------------------------------------------------

    def logprobs(self, batches: list[PackedBatch], with_entropy: bool = True, routing=None, *,
                 temperature: float = 1.0) -> list[dict[str, torch.Tensor]]:
        """Per-position logprobs of `labels` (and entropy) under softmax(logits / temperature) for
        each micro-batch, fp32, no grad.

        Returned on the last pipeline stage (an empty list elsewhere); identical on its TP ranks.
        """
        self.model.eval()
        with torch.no_grad():
            outputs = self._run(batches, forward_only=True, loss_fn=None, with_entropy=with_entropy, routing=routing,
                                temperature=temperature)
        self.model.train()
        return outputs if self.is_last_stage else []

    def train_step(self, batches: list[PackedBatch], loss_fn: LossFn, *, routing=None, lr: float | None = None,
                   temperature: float = 1.0) -> StepResult:
        """One optimizer step over all the micro-batches (gradients accumulate across them).

        `routing`: a RouterTrace replaying/comparing MoE routes per micro-batch (see model/routing.py).
        `lr`: a fixed learning rate for this step, outside the schedule (the supervised warm start).
        `temperature`: `loss_fn` sees the logprobs and entropy of softmax(logits / temperature)."""
        loss, outputs = self.forward_backward(batches, loss_fn, routing=routing, temperature=temperature)
        result = self.optimizer_step(loss, lr=lr)
        if self.is_last_stage:
            result.metrics = [{k: v for k, v in o.items() if k != "loss"} for o in outputs]
        return result

    def forward_backward(self, batches: list[PackedBatch], loss_fn: LossFn, routing=None, *,
                         temperature: float = 1.0) -> tuple[float, list[dict]]:
        """Accumulate gradients of the step loss; returns the loss summed over micro-batches and DP."""
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run(batches, forward_only=False, loss_fn=loss_fn, with_entropy=True, routing=routing,
                            temperature=temperature)
        local = torch.tensor(
            sum(float(o["loss"]) for o in outputs) if self.is_last_stage else 0.0, device=self.runtime.device
        )
        dist.all_reduce(local)  # DP ranks hold disjoint shares; other stages add 0
        return float(local) / (self.config.parallel.tp * self.config.parallel.cp), outputs  # TP/CP ranks hold copies

    def optimizer_step(self, loss: float, lr: float | None = None) -> StepResult:
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        else:
            # Re-apply the schedule's current rate (a fixed-rate step may have overridden it).
            self.scheduler.step(0)
        if not self._all_finite([buffer.grad_data for buffer in self._grad_buffers()]):
            # Megatron's clipping does not catch it (a NaN norm compares False with the limit):
            # Adam would write NaN into every weight. Skip it on every rank; the caller counts it.
            return StepResult(loss=loss, grad_norm=float("nan"), updated=False)
        used_lr = self.learning_rate
        updated, grad_norm, _ = self.optimizer.step()
        if updated and lr is None:
            self.scheduler.step(1)
        if not updated:
            return StepResult(loss=loss, grad_norm=float(grad_norm or 0.0), updated=False, lr=used_lr)
        norm = self.weight_norm()
        return StepResult(loss=loss, grad_norm=float(grad_norm or 0.0), updated=True,
                          weights_finite=math.isfinite(norm), weight_norm=norm, lr=used_lr)

    def advance_schedule(self, updates: int) -> None:
        """The learning-rate schedule moved on by `updates` updates not taken (a step's
        mini-batches with no data: train/update.py), so it stays on the run's timeline."""
        self.scheduler.step(updates)

    def weight_norm(self) -> float:
        """Collective: the L2 norm of the weights, the same number on every rank (every rank's
        parameters, so a weight replicated over ranks counts once per copy: a measure to compare
        between updates of one layout, what the update guard does). Each tensor's norm is taken in
        float32 without rescaling, so a weight beyond ~1e19 makes it infinite, as a NaN or an
        infinity does; such a model's next forward overflows anyway."""
        squares = [torch.linalg.vector_norm(param.detach(), dtype=torch.float32).double() ** 2
                   for param in self.model.parameters()]
        total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64)
        total = total.to(self.runtime.device)
        dist.all_reduce(total)  # every rank takes the same branch on it
        return math.sqrt(float(total))

    def _grad_buffers(self) -> list:
        return self.model.buffers + self.model.expert_parallel_buffers

    def _all_finite(self, tensors: list[torch.Tensor]) -> bool:
        """Whether every value of `tensors`, on every rank, is finite: one pass over them (as the
        gradient norm makes) and one scalar all-reduce."""
        if tensors:
            total = torch.stack([torch.sum(t, dtype=torch.float32) for t in tensors]).sum()
        else:
            total = torch.zeros((), device=self.runtime.device)
        bad = (~torch.isfinite(total)).to(torch.float32)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # every rank takes the same branch
        return not bool(bad)

    @property
    def learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------------------------------

    def save_model(self, directory: str) -> None:
        """Model weights as a Megatron `torch_dist` checkpoint (loadable at any layout)."""
        from megatron.core import dist_checkpointing

        os.makedirs(directory, exist_ok=True)
        dist_checkpointing.save(self.module.sharded_state_dict(), directory)

    def load_model(self, directory: str, without_frozen: bool = False) -> None:
        """Load weights saved by save_model, at this or any other layout.

        The embedding's padded row count must match (it depends on TP unless
        model.padded_vocab_size pins it); Megatron names the tensor if it does not.
        A checkpoint without LoRA adapters loads into a model with them (model.lora on a base
        trained without: `megatron-rl sft`, a full fine-tuning run): the adapters keep their
        initial values, B = 0, so the model is that checkpoint's exactly.
        `without_frozen`: `directory` holds everything but the frozen base (a LoRA checkpoint
        that refers to its base, loaded into this model already); the rest is loaded over it.
        """
        from megatron.core import dist_checkpointing

        with torch.no_grad():
            sharded = self.module.sharded_state_dict()
            fresh = set() if _holds_adapters(directory) else {name for name in sharded if is_adapter(name)}
            kept = fresh | (self.frozen_names() if without_frozen else set())
            state = dist_checkpointing.load({k: v for k, v in sharded.items() if k not in kept}, directory)
            missing, unexpected = self.module.load_state_dict(state, strict=not kept)
            if kept and (unexpected or set(missing) - kept):
                raise RuntimeError(f"loading {directory}: keys missing {sorted(set(missing) - kept)[:5]}, "
                                   f"unexpected {sorted(unexpected)[:5]}")
        # The optimizer keeps fp32 main copies (bf16) or shard views; refresh them from the model.
        self.optimizer.reload_model_params()

    def frozen_names(self) -> set[str]:
        """The parameters that never train (the base model under model.lora): their values are
        the initial weights' for the whole run."""
        return {name for name, param in self.module.named_parameters() if not param.requires_grad}

    def save_training_state(self, directory: str, keyed_like_weights: dict[str, dict[str, torch.Tensor]] | None = None,
                            async_save: bool = False, without_frozen: bool = False):
        """Model and optimizer (Adam's moments, fp32 main weights of a bf16 model) as one
        `torch_dist` checkpoint that reshards across TP, PP, EP and DP (see optimizer_state).
        `without_frozen`: the frozen parameters are left out (a LoRA checkpoint that refers to
        its base instead of holding it: checkpoint/base_check.py).

        `keyed_like_weights`: more per-parameter tensors ({prefix: {parameter name: tensor}},
        e.g. the KL reference weights), stored sharded exactly like the weights.
        Returns the small state the caller stores with its own trainer state (JSON): the LR
        schedule and Adam's step count; with `async_save`, also Megatron-Core's AsyncRequest
        (the files are written when the caller runs it), as (state, request)."""
        from megatron.core import dist_checkpointing

        os.makedirs(directory, exist_ok=True)
        gathered = self._optimizer_view().gather()
        sharded = self._training_sharded_state_dict(gathered, keyed_like_weights or {}, without_frozen)
        small = {"scheduler": self.scheduler.state_dict(), "adam_step": _adam_step(self.optimizer)}
        if async_save:
            return small, dist_checkpointing.save(sharded, directory, async_sharded_save=True)
        dist_checkpointing.save(sharded, directory)
        return small

    def load_training_state(self, directory: str, saved: dict, keyed_like_weights: tuple[str, ...] = (),
                            without_frozen: bool = False) -> dict:
        """`saved`: what save_training_state returned. Loads at this layout whatever layout the
        checkpoint was written at. Returns the `keyed_like_weights` prefixes asked for, as
        {prefix: {parameter name: tensor (CPU)}}. `without_frozen`: the checkpoint was saved so;
        the frozen parameters keep the values they have (the base, loaded before)."""
        from megatron.core import dist_checkpointing

        view = self._optimizer_view()
        # Host buffers: whole-parameter optimizer tensors are DP times what a rank of the
        # distributed optimizer keeps; only this rank's slice is copied to the device. Frozen
        # parameters (the base model under model.lora) have no optimizer state.
        template_values = {key: {name: torch.empty_like(p, dtype=torch.float32, device="cpu")
                                 for name, p in self.module.named_parameters() if p.requires_grad}
                           for key in view.states}
        extra_values = {prefix: {name: torch.empty_like(t, device="cpu") for name, t in trained_state(self.module)}
                        for prefix in keyed_like_weights}
        template = self._training_sharded_state_dict(template_values, extra_values, without_frozen)
        state = dist_checkpointing.load(template, directory)
        with torch.no_grad():  # the optimizer copies into views of parameters that require grad
            missing, unexpected = self.module.load_state_dict(state["model"], strict=not without_frozen)
            if set(missing) - self.frozen_names() or unexpected:
                raise RuntimeError(f"loading {directory}: keys missing {sorted(set(missing) - self.frozen_names())[:5]}, "
                                   f"unexpected {sorted(unexpected)[:5]}")
            self.optimizer.reload_model_params()  # main weights from the loaded model weights
            view.scatter(state["optimizer"])  # then the saved moments (and fp32 main weights)
        _set_adam_step(self.optimizer, saved["adam_step"])
        self.scheduler.load_state_dict(saved["scheduler"])
        return {prefix: {name: tensor.cpu() for name, tensor in state[prefix].items()} for prefix in keyed_like_weights}

    def _optimizer_view(self):
        from megatron_rl.model.optimizer_state import OptimizerStateView

        return OptimizerStateView(self.optimizer, self.module, with_main_params=self.config.model.precision != "fp32")

    def _training_sharded_state_dict(self, optimizer_values: dict, keyed_like_weights: dict,
                                     without_frozen: bool = False) -> dict:
        """{"model": the weights, "optimizer": {state: {name: ...}}, prefix: {name: ...}}: every
        per-parameter tensor sharded like its weight; the frozen ones left out `without_frozen`."""
        from megatron_rl.model.optimizer_state import keyed_like, param_entries

        model = self.module.sharded_state_dict()
        entries = param_entries(self.module, model)
        if without_frozen:
            frozen = self.frozen_names()
            model = {key: entry for key, entry in model.items() if key not in frozen}
        sharded = {"model": model,
                   "optimizer": {state: {name: keyed_like(entries[name], tensor, f"optimizer.{state}")
                                         for name, tensor in values.items()}
                                 for state, values in optimizer_values.items()}}
        for prefix, values in keyed_like_weights.items():
            sharded[prefix] = {name: keyed_like(entries[name], tensor, prefix) for name, tensor in values.items()}
        return sharded

    # ------------------------------------------------------------------------------------------

    def _run(self, batches, forward_only: bool, loss_fn: LossFn | None, with_entropy: bool, routing=None,
             temperature: float = 1.0):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not temperature > 0:  # also NaN: before any forward runs
            raise ValueError(f"temperature must be > 0 (the distribution is softmax(logits / temperature)), "
                             f"got {temperature}")
        if not batches:
            raise ValueError("no micro-batches to run: pack at least one sample")
        device = self.runtime.device
        real = len(batches)
        batches = [b.to(device) for b in self._equalize_microbatch_count(batches)]
        for batch in batches:
            if batch.num_tokens % self.pad_to_multiple:
                raise ValueError(
                    f"a packed micro-batch has {batch.num_tokens} tokens; it must be a multiple of "
                    f"{self.pad_to_multiple} (tp with sequence parallelism, times the FP8 alignment): "
                    "pack with pad_to_multiple=policy.pad_to_multiple"
                )

        def forward_step(data_iterator, model):
            index, batch = next(data_iterator)
            if routing is not None:
                routing.begin_microbatch(index)
            with cpu_compat.suspended():  # the forward names no CUDA device (see cpu_compat)
                output = model(
                    input_ids=batch.input_ids,
                    position_ids=batch.position_ids,
                    attention_mask=None,
                    packed_seq_params=batch.packed_seq_params(),
                )
            if routing is not None:
                routing.end_microbatch(index)
            return output, partial(self._loss, batch, loss_fn, with_entropy, temperature)

        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(enumerate(batches)),
            model=[self.model],
            num_microbatches=len(batches),
            seq_length=max(b.num_tokens for b in batches),
            micro_batch_size=1,
            forward_only=forward_only,
        )
        return outputs[:real]

    def _equalize_microbatch_count(self, batches: list[PackedBatch]) -> list[PackedBatch]:
        """Pad with empty micro-batches so every DP rank runs the same number.

        Expert parallelism exchanges tokens between DP ranks inside every MoE layer, so all of
        them must run the same number of forward/backward passes even when their samples packed
        into different numbers of micro-batches. An empty micro-batch is `pad_to_multiple`
        padding tokens with a zero loss mask: it adds nothing to the loss or the gradient.
        """
        count = torch.tensor(len(batches), device=self.runtime.device)  # NCCL reduces only GPU tensors
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.dp_group)
        missing = int(count) - len(batches)
        if missing == 0:
            return batches
        filler = pack([[0] * self.pad_to_multiple], [self.pad_to_multiple], sample_ids=[])
        filler.loss_mask.zero_()
        filler.spans = []
        return list(batches) + [filler] * missing

    def _loss(self, batch: PackedBatch, loss_fn: LossFn | None, with_entropy: bool, temperature: float,
              logits: torch.Tensor):
        with cpu_compat.suspended():
            return self._compute_loss(batch, loss_fn, with_entropy, temperature, logits)

    def _compute_loss(self, batch: PackedBatch, loss_fn: LossFn | None, with_entropy: bool, temperature: float,
                      logits: torch.Tensor):
        # logits: [1, T, V_local], vocab-sharded across TP (never gathered); the kernel divides each
        # chunk by the temperature as it upcasts it, so no tempered copy of the logits is made.
        vocab_local = logits.shape[-1]
        logprobs, entropy = vocab_parallel_logprobs_entropy(
            logits[0],
            batch.labels[0],
            vocab_start=self.runtime.tp_rank * vocab_local,
            vocab_size=self.arch.vocab_size,
            group=self.tp_group,
            chunk_tokens=self.config.logprob_chunk_tokens,
            temperature=temperature,
            compute_entropy=with_entropy,
        )
        num_tokens = batch.loss_mask.sum().to(torch.int)
        if loss_fn is None:
            report = {"logprobs": logprobs.detach(), "entropy": None if entropy is None else entropy.detach()}
            return logprobs.sum() * 0.0, num_tokens, report
        loss, metrics = loss_fn(logprobs, entropy, batch)
        return loss, num_tokens, {"loss": loss.detach(), **metrics}


def _adam_states(optimizer):
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        yield from getattr(getattr(chained, "optimizer", None), "state", {}).values()


def _adam_step(optimizer) -> float | None:
    steps = {float(state["step"]) for state in _adam_states(optimizer) if "step" in state}
    if len(steps) > 1:
        raise RuntimeError(f"optimizer parameters are at different Adam steps {sorted(steps)}")
    return steps.pop() if steps else None


def _set_adam_step(optimizer, step: float | None) -> None:
    """Restore Adam's step count (its bias correction) after a checkpoint load, one tensor per
    parameter.

    Megatron-Core 0.16's DistributedOptimizer, on the path without Apex/TE (CPU), does not bring
    the saved step back into a freshly built optimizer: it stayed at the placeholder value, and
    when it was restored it was ONE tensor shared by every parameter, which torch's Adam then
    incremented once per parameter per update. The exact-resume test caught both; we store the
    step with our own trainer state instead."""
    if step is None:
        return
    for state in _adam_states(optimizer):
        if "step" in state:
            state["step"] = torch.tensor(step, dtype=torch.float32)


def _lr_scheduler(optimizer, opt, total_steps: int):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = opt.lr_decay_steps or max(total_steps, opt.lr_warmup_steps + 1)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if opt.lr_warmup_steps else opt.lr,
        max_lr=opt.lr,
        min_lr=opt.effective_min_lr,
        lr_warmup_steps=opt.lr_warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=opt.lr_decay_style,
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
        # Resume restores the schedule's position (its step count) from the checkpoint and takes
        # every setting (lr, min_lr, warm-up, decay, weight decay) from this run's config: with
        # checkpoint.allow_config_change a changed optimizer key takes effect. (Megatron's
        # default keeps the checkpoint's values; the param groups' own max_lr / min_lr still
        # overrode them, so a changed lr took effect and a changed weight decay did not.)
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


def _finalize_without_token_scaling(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    from megatron.core.distributed import finalize_model_grads

    # Reduce grads over DP (sum), embeddings across stages and SP norms across TP, but do not
    # divide by a token count: the loss was normalized over the whole step already.
    return finalize_model_grads(model, num_tokens=None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)


def _holds_adapters(directory: str) -> bool:
    """Whether a torch_dist checkpoint holds LoRA adapters (a LoRA run's)."""
    from megatron.core import dist_checkpointing

    return any(is_adapter(key) for key in dist_checkpointing.load_tensors_metadata(directory))
