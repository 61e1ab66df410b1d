"""One rank of a bridge check, started by torchrun (or alone). Modes:

  roundtrip   HF dir -> sharded Megatron (load_hf_weights) -> HF dir (export), plus the Megatron
              logits of fixed tokens (vocab gathered across TP, padding trimmed)
  train       the same import, then optimizer steps through the Policy, then export and logits;
              before the first step changes the weights, the packed samples' response logprobs and
              entropy at TEMPERATURE, from Policy.logprobs and as the loss function of that first
              training step sees them (tempered.pt)

    python bridge_worker.py MODE --hf HF_DIR --out OUT_DIR [--override k=v ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.checkpoint.atomic_dir import AtomicDirectory
from megatron_rl.bridge import export_hf_weights, load_hf_weights, owned_hf_names
from megatron_rl.bridge.hf_checkpoint import write_hf_checkpoint
from megatron_rl.config import load_config
from megatron_rl.model.builder import build_model
from megatron_rl.model.packing import pack, pack_by_token_budget
from megatron_rl.runtime import start_runtime

TOKENS = [3, 17, 99, 250, 7, 42, 311, 5, 480, 64, 128, 2, 77, 199, 13, 401, 9, 333, 21, 150]
# The sampling temperature of the train mode's logprob checks (tests/bridge/test_bridge.py).
TEMPERATURE = 0.6


def megatron_logits(module, arch, pad_to_multiple: int) -> torch.Tensor | None:
    """Full-vocab logits [T, V] of TOKENS from a direct forward (no pipeline: pp must be 1)."""
    from megatron.core import parallel_state as ps

    batch = pack([TOKENS], [1], pad_to_multiple=pad_to_multiple)
    module.eval()
    with torch.no_grad():
        logits = module(
            input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=None,
            packed_seq_params=batch.packed_seq_params(),
        )[0]
    group = ps.get_tensor_model_parallel_group()
    if group.size() > 1:
        shards = [torch.empty_like(logits) for _ in range(group.size())]
        dist.all_gather(shards, logits.contiguous(), group=group)
        logits = torch.cat(shards, dim=-1)
    return logits[: len(TOKENS), : arch.vocab_size]


def per_sample(batches, outputs: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """{sample id: its response values} from one per-position tensor per packed micro-batch."""
    values = {}
    for batch, output in zip(batches, outputs):
        values.update(zip(batch.sample_ids, (v.detach().clone() for v in batch.response_values(output))))
    return values


def tempered_step(policy, batches, normalizer) -> dict:
    """Response logprobs and entropy at TEMPERATURE from Policy.logprobs, then one training step at
    TEMPERATURE whose loss function records what it is given (its forward runs on the weights
    before the update)."""
    outputs = policy.logprobs(batches, temperature=TEMPERATURE)
    seen = []

    def loss_fn(logprobs, entropy, batch):
        seen.append((logprobs.detach().clone(), entropy.detach().clone()))
        return -(logprobs * batch.loss_mask[0]).sum() / normalizer, {}

    policy.train_step(batches, loss_fn, temperature=TEMPERATURE)
    return {"logprobs": per_sample(batches, [o["logprobs"] for o in outputs]),
            "entropy": per_sample(batches, [o["entropy"] for o in outputs]),
            "train_logprobs": per_sample(batches, [lp for lp, _ in seen]),
            "train_entropy": per_sample(batches, [ent for _, ent in seen])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["roundtrip", "train"])
    parser.add_argument("--hf", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--override", action="append", default=[])
    args = parser.parse_args()
    config = load_config(None, ["device=cpu", f"model.hf_config={args.hf}", "optimizer.lr=0.001", *args.override])
    runtime = start_runtime(config)
    out = Path(args.out)
    pad = config.parallel.tp if config.parallel.uses_sequence_parallel else 1

    if args.mode == "roundtrip":
        built = build_model(config, runtime.device)
        module, arch, raw = built.module, built.arch, built.raw_hf_config
        load_hf_weights(module, arch, args.hf)
    else:
        from megatron_rl.algorithms import compute_step_normalizer
        from megatron_rl.model.policy import Policy

        policy = Policy(config, runtime)
        module, arch, raw = policy.module, policy.arch, policy.raw_hf_config
        load_hf_weights(module, arch, args.hf)
        policy.optimizer.reload_model_params()
        generator = torch.Generator().manual_seed(0)
        samples = [torch.randint(0, arch.vocab_size, (n,), generator=generator).tolist() for n in (20, 31, 9)]
        prompts = [3, 5, 2]
        batches = pack_by_token_budget(samples, prompts, 64, pad)  # two samples share the first micro-batch
        normalizer = compute_step_normalizer([b.loss_mask for b in batches], group=policy.dp_group, device=runtime.device).num_tokens
        tempered = tempered_step(policy, batches, normalizer)
        if dist.get_rank() == 0:
            torch.save(dict(tempered, samples=samples, prompts=prompts, temperature=TEMPERATURE), out / "tempered.pt")
        policy.train_step(batches, lambda lp, ent, b: (-(lp * b.loss_mask[0]).sum() / normalizer, {}))

    # Weight sync relies on owned_hf_names: it must list exactly what this rank's export yields.
    yielded = [name for bucket in export_hf_weights(module, arch, bucket_bytes=1 << 16) for name, _ in bucket]
    owned = owned_hf_names(module, arch)
    assert sorted(yielded) == sorted(owned), (sorted(set(yielded) ^ set(owned)))[:5]
    assert len(yielded) == len(set(yielded)), "a name was exported twice"

    with AtomicDirectory(out / "hf") as staging:
        write_hf_checkpoint(module, arch, raw, staging, template_dir=args.hf, bucket_bytes=64 << 10)
    if config.parallel.pp == 1:
        logits = megatron_logits(module, arch, pad)
        if dist.get_rank() == 0:
            torch.save(logits, out / "megatron_logits.pt")
    dist.barrier()
    runtime.shutdown()


if __name__ == "__main__":
    main()
