"""One rank of a real training run at a parallel layout: the bytes its training state occupies,
read from Megatron's own objects after an optimizer step (test_state_bytes.py, under torchrun).

    torchrun --nproc-per-node N state_worker.py OUT_DIR MODEL [key=value ...]

Per rank, OUT_DIR/MODEL-rank<r>.json holds:
  params       the DDP buffers' parameter storage (distributed optimizer), else every parameter,
               and the frozen parameters (model.lora's base) outside the buffers
  grads        the DDP buffers' gradient storage
  main_params  the fp32 main weights the optimizer keeps for bf16 parameters
  moments      Adam's exp_avg and exp_avg_sq
and where the rank sits: pipeline stage, data-parallel rank (with context parallelism) and
expert-data-parallel rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def _nbytes(tensor) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def measure(policy) -> dict:
    from megatron.core import parallel_state

    ddp = policy.model
    buffers = ddp.buffers + ddp.expert_parallel_buffers
    distributed = policy.config.parallel.distributed_optimizer
    params = (sum(_nbytes(b.param_data) for b in buffers) if distributed
              else sum(_nbytes(p) for p in policy.module.parameters() if p.requires_grad))
    # Frozen parameters (the base under model.lora) are in no buffer: each is its own tensor.
    params += sum(_nbytes(p) for p in policy.module.parameters() if not p.requires_grad)
    optimizers = getattr(policy.optimizer, "chained_optimizers", [policy.optimizer])
    main = moments = 0
    for optimizer in optimizers:
        groups = getattr(optimizer, "shard_fp32_from_float16_groups", None)
        if groups is None:  # not distributed: Float16OptimizerWithFloat16Params
            groups = getattr(optimizer, "fp32_from_float16_groups", [])
        main += sum(_nbytes(t) for group in groups for t in group)
        for state in optimizer.optimizer.state.values():
            moments += _nbytes(state.get("exp_avg")) + _nbytes(state.get("exp_avg_sq"))
    return {
        "params": params, "grads": sum(_nbytes(b.grad_data) for b in buffers), "main_params": main, "moments": moments,
        "stage": parallel_state.get_pipeline_model_parallel_rank(),
        "dp_rank": parallel_state.get_data_parallel_rank(with_context_parallel=True),
        "expert_dp_rank": parallel_state.get_expert_data_parallel_rank(),
    }


def main(out: Path, model: str, overrides: list[str]) -> None:
    import torch.distributed as dist

    from megatron_rl.config import load_config
    from megatron_rl.model.packing import pack
    from megatron_rl.model.policy import Policy
    from megatron_rl.runtime import start_runtime

    config = load_config(None, ["device=cpu", f"model.hf_config={model}", *overrides])
    runtime = start_runtime(config)
    policy = Policy(config, runtime)
    generator = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, policy.arch.vocab_size, (n,), generator=generator).tolist() for n in (12, 9)]
    batch = pack(samples, [4, 3], pad_to_multiple=policy.pad_to_multiple)

    def loss_fn(logprobs, entropy, batch):
        mask = batch.loss_mask.to(logprobs.device)
        return -(logprobs * mask).sum() / mask.sum(), {}

    step = policy.train_step([batch], loss_fn)  # Adam's moments exist after the first step
    result = {**measure(policy), "updated": step.updated}
    (out / f"{model}-rank{dist.get_rank()}.json").write_text(json.dumps(result))
    runtime.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
