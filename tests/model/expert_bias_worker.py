"""Aux-loss-free load balancing on a live model (one process, or several under torchrun).

    python expert_bias_worker.py HF_CONFIG OUT.json [RATE] [--override k=v ...]

One update of a DeepSeek-V3-style model (sigmoid router with expert bias) with routing replay:
records each token's experts in a no-grad forward, replays them in the training forward, and
writes what an independent re-derivation needs (the bias before and after, the recorded expert
counts summed over every rank), plus what the bridge exports, what the KL reference swaps in,
and what a checkpoint saved after the update restores.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
import torch.distributed as dist


def biases(module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in module.named_buffers() if name.endswith("router.expert_bias")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("hf_config")
    parser.add_argument("out")
    parser.add_argument("--override", action="append", default=[])
    args = parser.parse_args()

    from megatron_rl.bridge import export_hf_weights
    from megatron_rl.config import load_config
    from megatron_rl.model.packing import pack
    from megatron_rl.model.policy import Policy
    from megatron_rl.model.routing import RouterTrace
    from megatron_rl.runtime import start_runtime
    from megatron_rl.model.reference import ReferenceWeights

    config = load_config(None, ["device=cpu", f"model.hf_config={args.hf_config}", "optimizer.lr=0.01", *args.override])
    runtime = start_runtime(config)
    policy = Policy(config, runtime)
    rank = dist.get_rank() if dist.is_initialized() else 0
    with torch.no_grad():  # a non-zero starting bias, the same on every rank
        for index, (_, bias) in enumerate(sorted(biases(policy.module).items())):
            bias.copy_(0.05 * torch.randn(bias.shape, generator=torch.Generator().manual_seed(index)))
    generator = torch.Generator().manual_seed(1 + rank)  # each data-parallel rank its own samples
    samples = [torch.randint(0, policy.arch.vocab_size, (n,), generator=generator).tolist() for n in (23, 9, 31, 14)]
    batches = [pack(samples, [3, 2, 5, 4], pad_to_multiple=policy.pad_to_multiple)]
    reference = ReferenceWeights.snapshot(policy.module)
    before = biases(policy.module)

    trace = RouterTrace.attach()
    trace.start("record")
    policy.logprobs(batches, routing=trace)
    # Tokens each expert received in the recorded routes, per MoE layer of this rank's stage.
    counts = [torch.bincount(routes.reshape(-1), minlength=policy.arch.num_experts).float()
              for routes in trace.recorded_routes(0)]
    trace.start("replay")
    normalizer = sum(len(s) for s in samples)
    policy.train_step(batches, lambda lp, ent, b: (-(lp * b.loss_mask[0]).sum() / normalizer, {}), routing=trace)
    trace.stop()
    after = biases(policy.module)
    stacked = torch.stack(counts)
    if dist.is_initialized():
        dist.all_reduce(stacked)  # the update sums the counts over tensor and data parallel ranks

    exported = {}
    for bucket in export_hf_weights(policy.module, policy.arch):
        exported.update({name: t.tolist() for name, t in bucket if name.endswith("e_score_correction_bias")})
    with reference.swapped_in(policy.module):
        in_reference = biases(policy.module)
    restored_after_reference = biases(policy.module)

    with tempfile.TemporaryDirectory() as directory:
        if dist.is_initialized():
            shared = [directory]
            dist.broadcast_object_list(shared, src=0)
            directory = shared[0]
        saved = policy.save_training_state(directory, keyed_like_weights={"reference": reference.tensors})
        with torch.no_grad():  # forget the bias, so only the checkpoint can bring it back
            for name, bias in policy.module.named_buffers():
                if name.endswith("router.expert_bias"):
                    bias.zero_()
        extra = policy.load_training_state(directory, saved, keyed_like_weights=("reference",))
        if dist.is_initialized():
            dist.barrier()
    loaded = biases(policy.module)
    loaded_reference = {name: t for name, t in extra["reference"].items() if name.endswith("router.expert_bias")}

    result = {
        "rate": policy.tconfig.moe_router_bias_update_rate,
        "names": sorted(before),
        "before": {n: t.tolist() for n, t in before.items()},
        "after": {n: t.tolist() for n, t in after.items()},
        "counts": stacked.tolist(),
        "exported": exported,
        "reference_equal_before": all(torch.equal(in_reference[n], before[n]) for n in before),
        "live_restored_after_reference": all(torch.equal(restored_after_reference[n], after[n]) for n in after),
        "checkpoint_restores": all(torch.equal(loaded[n], after[n]) for n in after),
        "checkpoint_reference_equal_before": all(torch.equal(loaded_reference[n], before[n]) for n in before),
        "drift": trace.drift(),
    }
    with open(f"{args.out}.rank{rank}.json", "w") as handle:
        json.dump(result, handle)
    runtime.shutdown()


if __name__ == "__main__":
    main()
