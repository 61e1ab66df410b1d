"""One rank of a resharding run, started by torchrun (see test_resharding.py).

    save:   start from shared weights, take 2 optimizer steps (so Adam's moments are not zero
            and the LR schedule has moved), save the training state with KL reference weights,
            then continue with the 2 steps a resume takes (what a same-layout resume must equal)
    resume: load that state at THIS layout, write the reference weights as full tensors, take
            2 more steps and write their losses and grad norms

`--drop-moments` (resume): zero Adam's moments after loading; a control showing the comparison
notices when the optimizer state does not come back.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.config import load_config
from megatron_rl.model.policy import Policy
from megatron_rl.runtime import start_runtime

# The layout-parity suite's samples (tests/model/parity_worker.py), so both suites train on the same data.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from parity_worker import nll_batches  # noqa: E402

# Several warmup steps make the LR depend on the restored schedule position.
OVERRIDES = ["device=cpu", "optimizer.lr=0.003", "optimizer.clip_grad=1.0", "optimizer.lr_warmup_steps=3",
             "optimizer.weight_decay=0.01"]


def take_steps(policy: Policy, runtime, count: int, shift: int) -> dict:
    batches, loss_fn = nll_batches(policy, runtime, shift)
    losses, norms, lrs = [], [], []
    for _ in range(count):
        result = policy.train_step(batches, loss_fn)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        lrs.append(policy.learning_rate)
    # The weight decays the optimizer applied (biases and norms: none), and whether every param
    # group used the rate reported as the learning rate.
    decays = sorted({group["weight_decay"] for group in policy.optimizer.param_groups})
    same_lr = all(group["lr"] == policy.learning_rate for group in policy.optimizer.param_groups)
    return {"loss": losses, "grad_norm": norms, "lr": lrs, "weight_decay": decays, "one_lr": same_lr}


def full_tensors(policy: Policy, values: dict[str, torch.Tensor], directory: Path) -> dict[str, torch.Tensor]:
    """Per-parameter tensors of this layout as global (layout-independent) tensors, via a
    torch_dist round trip with the model's own sharding metadata."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import load_plain_tensors

    from megatron_rl.model.optimizer_state import keyed_like, param_entries

    entries = param_entries(policy.module, policy.module.sharded_state_dict())
    if dist.get_rank() == 0:
        directory.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save({name: keyed_like(entries[name], values[name], "full") for name in values}, str(directory))
    return {k: v for k, v in load_plain_tensors(str(directory)).items() if torch.is_tensor(v)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "resume"])
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--weights", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--override", action="append", default=[])
    parser.add_argument("--drop-moments", action="store_true")
    args = parser.parse_args()
    out, ckpt = Path(args.out), Path(args.ckpt)

    config = load_config(None, [*OVERRIDES, *args.override])
    runtime = start_runtime(config)
    policy = Policy(config, runtime, total_steps=20)
    if args.mode == "save":
        exists = Path(args.weights).exists()
        dist.barrier()  # every rank looked before any writes
        if not exists:  # the first save of the test writes the shared starting weights
            policy.save_model(args.weights)
        policy.load_model(args.weights)
        reference = {name: p.detach().to("cpu", copy=True) for name, p in policy.module.named_parameters()}
        result = take_steps(policy, runtime, 2, shift=0)
        small = policy.save_training_state(str(ckpt), keyed_like_weights={"reference": reference})
        if runtime.rank == 0:
            (ckpt / "small.json").write_text(json.dumps(small))
        # What a resume at this layout must reproduce exactly: the same run simply continuing.
        result["continued"] = take_steps(policy, runtime, 2, shift=5)
    else:
        small = json.loads((ckpt / "small.json").read_text())
        loaded = policy.load_training_state(str(ckpt), small, keyed_like_weights=("reference",))
        if args.drop_moments:
            from megatron_rl.model.policy import _adam_states

            for state in _adam_states(policy.optimizer):
                state["exp_avg"].zero_()
                state["exp_avg_sq"].zero_()
        reference = full_tensors(policy, loaded["reference"], out / "reference_full")
        if runtime.rank == 0:
            torch.save(reference, out / "reference.pt")
        result = take_steps(policy, runtime, 2, shift=5)
    if runtime.rank == 0:
        from megatron.core import parallel_state as ps

        result["layout"] = {"world": dist.get_world_size(), "tp": ps.get_tensor_model_parallel_world_size(),
                            "ep": ps.get_expert_model_parallel_world_size(), "dp": ps.get_data_parallel_world_size(),
                            "distributed_optimizer": config.parallel.distributed_optimizer}
        (out / f"{args.mode}.json").write_text(json.dumps(result))
    dist.barrier()
    runtime.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
