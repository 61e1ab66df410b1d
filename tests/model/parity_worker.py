"""One rank of a parity run, started by torchrun (or as a single process for the reference).

Every layout runs the same script on the same data with the same starting weights:
  1. weights: the reference saves its freshly initialised model as `torch_dist`; layouts load it
     (Megatron reshards on load, independently of our code);
  2. per-token logprobs of every sample's response tokens (written per sample id);
  3. the gradient of one step, written as a `torch_dist` checkpoint of the model's sharded state
     dict with the gradients in place of the weights, so Megatron's own sharding metadata (fused
     QKV, SwiGLU halves, expert ids, pipeline layer offsets) turns every layout into full tensors;
  4. the loss of 3 optimizer steps;
  5. with model.lora, the merged HF export after those steps (every stage's leader its layers).
The test (test_parity.py) compares these files with the reference's.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.config import load_config
from megatron_rl.model.packing import pack_by_token_budget
from megatron_rl.algorithms import compute_step_normalizer
from megatron_rl.model.policy import Policy
from megatron_rl.runtime import start_runtime

NUM_SAMPLES = 12
TOKEN_BUDGET = 96


def make_samples(vocab_size: int):
    generator = torch.Generator().manual_seed(1234)
    samples, prompts = [], []
    for _ in range(NUM_SAMPLES):
        length = int(torch.randint(8, 48, (1,), generator=generator))
        prompt = int(torch.randint(2, length - 2, (1,), generator=generator))
        samples.append(torch.randint(0, vocab_size, (length,), generator=generator).tolist())
        prompts.append(prompt)
    return samples, prompts


def nll_batches(policy: Policy, runtime, shift: int = 0):
    """This DP rank's share of the samples, packed, and a summed-NLL loss normalized over the whole
    step (all micro-batches, all DP ranks): what the resharding and layout-matrix workers train on.
    `shift` rotates the samples (other data for later steps)."""
    samples, prompts = make_samples(policy.arch.vocab_size)
    samples, prompts = samples[shift:] + samples[:shift], prompts[shift:] + prompts[:shift]
    mine = list(range(runtime.dp_rank, NUM_SAMPLES, runtime.dp_size))
    batches = pack_by_token_budget([samples[i] for i in mine], [prompts[i] for i in mine], TOKEN_BUDGET,
                                   policy.pad_to_multiple)
    normalizer = compute_step_normalizer([b.loss_mask for b in batches], group=policy.dp_group,
                                         device=runtime.device).num_tokens

    def loss_fn(logprobs, entropy, batch):
        return -(logprobs * batch.loss_mask[0]).sum() / normalizer, {}

    return batches, loss_fn


def gather_distributed_optimizer_grads(ddp) -> None:
    """With the distributed optimizer each DP rank holds only its shard of the reduced gradient.

    Zero the other shards and all-reduce, so every rank holds the full reduced gradient (test only).
    """
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for bucket_group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        group = bucket_group.intra_distributed_optimizer_instance_group
        size, rank = group.size(), group.rank()
        if size == 1:
            continue
        for bucket in bucket_group.buckets:
            for index, shard in enumerate(shard_buffer(bucket.grad_data, size)):
                if index != rank:
                    shard.zero_()
            dist.all_reduce(bucket.grad_data, group=group)


def built_distributed_optimizer(optimizer) -> bool | str:
    """Whether the optimizer Megatron built is its DistributedOptimizer (for an MoE model, a
    ChainedOptimizer of a dense and an expert one: both), whatever the config asked for."""
    from megatron.core.optimizer import DistributedOptimizer

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    kinds = {isinstance(part, DistributedOptimizer) for part in parts}
    return kinds.pop() if len(kinds) == 1 else f"mixed: {[type(part).__name__ for part in parts]}"


def save_grads(policy: Policy, directory: Path) -> None:
    from megatron.core import dist_checkpointing

    params = [p for p in policy.module.parameters()]
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for param in params:
            # A frozen parameter (the base under model.lora) has no gradient buffer: zeros.
            grad = getattr(param, "main_grad", None)
            param.copy_(grad.to(param.dtype) if grad is not None else torch.zeros_like(param))
    directory.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(policy.module.sharded_state_dict(), str(directory))
    with torch.no_grad():
        for param, value in zip(params, saved):
            param.copy_(value)
    # Megatron reassembles the global (layout-independent) tensors from the checkpoint.
    from megatron.core.dist_checkpointing.serialization import load_plain_tensors

    full = {k: v for k, v in load_plain_tensors(str(directory)).items() if torch.is_tensor(v)}
    if dist.get_rank() == 0:
        torch.save(full, directory.parent / "grads.pt")


def save_merged_export(policy: Policy, out: Path) -> None:
    """5 (model.lora): the HF export after the steps, each adapter merged into its weight. Only
    each pipeline stage's leader receives tensors (its own layers), so the files of all ranks
    together are the whole merged model."""
    from megatron_rl.bridge import export_hf_weights

    tensors = {name: t.clone() for bucket in export_hf_weights(policy.module, policy.arch) for name, t in bucket}
    if tensors:
        torch.save(tensors, out / f"merged_rank{dist.get_rank()}.pt")


def set_adapters_nonzero(module) -> None:
    generator = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith(".lora_B"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)


def recipe_loss(name: str, policy: Policy, batches, first_logprobs):
    """A GRPO-family loss from megatron_rl.algorithms on the packed micro-batches.

    Old logprobs are the policy's own before the first step (so later steps have ratios != 1 and
    clipping engages); advantages come from fixed per-group rewards.
    """
    from megatron_rl.algorithms import compute_advantages, compute_step_normalizer, policy_loss, recipe, segments_to_padded

    setting = recipe(name, kl_coef=0.0) if name == "grpo" else recipe(name)
    rewards = torch.Generator().manual_seed(7)
    rewards = torch.randint(0, 2, (NUM_SAMPLES // 4, 4), generator=rewards).double()
    rewards[0] = torch.tensor([1.0, 0.0, 0.0, 1.0])  # at least one group with spread
    advantages = compute_advantages(rewards, estimator=setting.advantage_estimator).reshape(-1).float()
    old = {}  # sample id -> old logprobs of its response (last pipeline stage only)
    for batch, output in zip(batches, first_logprobs):
        for sample_id, values in zip(batch.sample_ids, batch.response_values(output["logprobs"])):
            old[sample_id] = values.detach()
    masks = [segments_to_padded(batch.loss_mask[0], batch.response_segments())[1] for batch in batches]
    normalizer = compute_step_normalizer(masks, setting.loss.loss_agg_mode, group=policy.dp_group)

    def loss_fn(logprobs, entropy, batch):
        segments = batch.response_segments()
        current, mask = segments_to_padded(logprobs, segments)
        old_padded = _pad_like(current, [old[i] for i in batch.sample_ids])
        loss, _ = policy_loss(current, old_padded, advantages[batch.sample_ids], mask, setting.loss, normalizer=normalizer)
        return loss, {}

    return loss_fn


def _pad_like(reference: torch.Tensor, rows: list[torch.Tensor]) -> torch.Tensor:
    """Rows zero-padded to the [n, width] layout of `reference`."""
    padded = torch.zeros_like(reference)
    for index, row in enumerate(rows):
        padded[index, : row.numel()] = row
    return padded


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--weights", required=True)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--override", action="append", default=[])
    parser.add_argument("--recipe", default=None, help="a megatron_rl.algorithms recipe instead of plain NLL")
    parser.add_argument("--nonzero-adapters", action="store_true",
                        help="reference with model.lora: give every B random values before saving the weights, so "
                             "that the first step has gradients for A too (B = 0 gives A none)")
    args = parser.parse_args()
    out = Path(args.out)

    config = load_config(None, ["device=cpu", "optimizer.lr=0.001", "optimizer.clip_grad=0.0", *args.override])
    runtime = start_runtime(config)
    policy = Policy(config, runtime)
    if args.reference:
        if args.nonzero_adapters:
            set_adapters_nonzero(policy.module)
        policy.save_model(args.weights)
    else:
        policy.load_model(args.weights)

    samples, prompts = make_samples(policy.arch.vocab_size)
    mine = list(range(runtime.dp_rank, NUM_SAMPLES, runtime.dp_size))  # this DP rank's samples
    batches = pack_by_token_budget(
        [samples[i] for i in mine], [prompts[i] for i in mine], TOKEN_BUDGET, policy.pad_to_multiple
    )
    for batch in batches:
        batch.sample_ids = [mine[i] for i in batch.sample_ids]

    # 2. logprobs (last pipeline stage, TP rank 0 writes; DP ranks write their own samples)
    outputs = policy.logprobs(batches)
    if outputs and runtime.tp_rank == 0:
        per_sample = {}
        for batch, output in zip(batches, outputs):
            for sample_id, lp, ent in zip(
                batch.sample_ids, batch.response_values(output["logprobs"]), batch.response_values(output["entropy"])
            ):
                per_sample[sample_id] = {"logprobs": lp.clone(), "entropy": ent.clone()}
        torch.save(per_sample, out / f"logprobs_rank{runtime.rank}.pt")

    # 3 and 4: the loss, normalized over the whole step (all micro-batches, all DP ranks)
    if args.recipe is None:
        normalizer = compute_step_normalizer([b.loss_mask for b in batches], group=policy.dp_group, device=runtime.device).num_tokens

        def loss_fn(logprobs, entropy, batch):
            return -(logprobs * batch.loss_mask[0]).sum() / normalizer, {}
    else:
        loss_fn = recipe_loss(args.recipe, policy, batches, outputs)

    losses, grad_norms = [], []
    for step in range(3):
        loss, _ = policy.forward_backward(batches, loss_fn)
        if step == 0:
            if policy.model.ddp_config.use_distributed_optimizer:  # the gradients are DP-sharded
                gather_distributed_optimizer_grads(policy.model)
            save_grads(policy, out / "grads")
        result = policy.optimizer_step(loss)
        losses.append(result.loss)
        grad_norms.append(result.grad_norm)
    if runtime.rank == 0:
        from megatron.core import parallel_state as ps

        layout = {
            "world": dist.get_world_size(),
            "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size(),
            "etp": ps.get_expert_tensor_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(),
            "distributed_optimizer": built_distributed_optimizer(policy.optimizer),
            "config_distributed_optimizer": config.parallel.distributed_optimizer,
            "precision": config.model.precision,
        }
        (out / "losses.json").write_text(json.dumps({"loss": losses, "grad_norm": grad_norms, "layout": layout}))
    if config.model.lora is not None:
        save_merged_export(policy, out)
    dist.barrier()
    runtime.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
