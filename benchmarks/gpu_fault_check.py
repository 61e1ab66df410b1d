"""The fault protections that run on the trainer's tensors, checked on a CUDA GPU (docs/faults.md).

    python benchmarks/gpu_fault_check.py --out RESULTS.md     # one process; sets its own rank env

On CPU the suite checks them (tests/model/test_policy_cpu.py, tests/rollout/test_engine_failover.py);
what only a GPU shows:

1. The non-finite update guard (model/policy.py) with the bf16 mixed-precision path and the
   distributed optimizer on CUDA: a NaN gradient skips the update and leaves every weight bit for bit
   as it was; a good update goes through; a learning rate of 1e30 is reported as non-finite weights.
   Its cost: the two checks' time against the optimizer step's, measured in the same run.
2. The push digest (rollout/weights/digest.py) of the policy's exported weights computed on the GPU
   against the same tensors on the CPU: the relative difference must stay under the tolerance the
   trainer and engine compare with (a GPU trainer and a CPU or GPU engine reduce in another order).
   Its cost against copying the same tensors once (what any push does at least).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def synchronized(call):
    synchronize()
    started = time.perf_counter()
    value = call()
    synchronize()
    return value, time.perf_counter() - started


def guard_check(policy) -> dict:
    from megatron_rl.model.packing import pack

    generator = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, policy.arch.vocab_size, (n,), generator=generator).tolist() for n in (96, 64, 80)]
    batches = [pack(samples, [8, 6, 7], pad_to_multiple=8)]

    def loss_with(scale: float):
        def loss_fn(logprobs, entropy, batch):
            mask = batch.loss_mask.to(logprobs.device)
            return -(logprobs * mask).sum() / mask.sum() * scale, {}
        return loss_fn

    def weights():
        return torch.cat([p.detach().float().flatten().clone() for p in policy.module.parameters()])

    before = weights()
    nan_step = policy.train_step(batches, loss_with(float("nan")))
    after_nan = weights()
    good_step = policy.train_step(batches, loss_with(1.0))
    after_good = weights()
    # The checks' cost: the step without them (Megatron's own step) vs the two reductions alone.
    policy.forward_backward(batches, loss_with(1.0))
    _, step_s = synchronized(lambda: policy.optimizer.step())
    buffers = [buffer.grad_data for buffer in policy._grad_buffers()]
    params = [p.detach() for p in policy.model.parameters()]
    _, checks_s = synchronized(lambda: (policy._all_finite(buffers), policy.weight_norm()))
    for group in policy.optimizer.param_groups:
        group["max_lr"] = group["min_lr"] = 1e30
    blown = policy.train_step(batches, loss_with(1.0), lr=1e30)
    return {
        "nan_step": (nan_step.updated, nan_step.grad_norm, nan_step.weights_finite),
        "nan_changed": int((after_nan != before).sum()),
        "good_step": (good_step.updated, good_step.grad_norm, good_step.weights_finite),
        "good_changed": int((after_good != after_nan).sum()),
        "blown_step": (blown.updated, blown.weights_finite),
        "step_s": step_s, "checks_s": checks_s,
        "params": sum(p.numel() for p in params),
    }


def digest_check(policy) -> dict:
    from megatron_rl.rollout.weights.digest import RELATIVE_TOLERANCE, WeightDigest
    from megatron_rl.rollout.weights.stream import hf_weight_stream

    tensors = [tensor.detach().clone() for _, tensor in hf_weight_stream(policy.module, policy.arch)]
    on_gpu = WeightDigest()
    _, digest_s = synchronized(lambda: [on_gpu.add(t) for t in tensors])
    _, copy_s = synchronized(lambda: [t.clone() for t in tensors])
    on_cpu = WeightDigest()
    for tensor in tensors:
        on_cpu.add(tensor.cpu())

    def relative(a: float, b: float) -> float:
        return abs(a - b) / max(abs(a), abs(b), 1e-300)

    return {
        "tensors": on_gpu.tensors, "values": on_gpu.numel, "device": str(tensors[0].device),
        "dtype": str(tensors[0].dtype),
        "total_rel": relative(on_gpu.total, on_cpu.total), "squares_rel": relative(on_gpu.squares, on_cpu.squares),
        "matches": on_gpu.matches(on_cpu), "tolerance": RELATIVE_TOLERANCE,
        "digest_s": digest_s, "copy_s": copy_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="tiny-qwen3-moe")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    args = parser.parse_args()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    from megatron_rl.config import load_config
    from megatron_rl.model.policy import Policy
    from megatron_rl.runtime import start_runtime

    config = load_config(None, [f"device={args.device}", f"model.hf_config={args.model}", "model.precision=bf16",
                                "parallel.distributed_optimizer=true"])
    runtime = start_runtime(config)
    policy = Policy(config, runtime)
    guard = guard_check(policy)
    digest = digest_check(policy)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (dry run)"
    lines = [
        f"# Fault protections on CUDA: {name}",
        "",
        f"`python benchmarks/gpu_fault_check.py` (torch {torch.__version__}), {args.model}, bf16, distributed "
        f"optimizer, one GPU, {guard['params']} parameters.",
        "",
        "| check | result |",
        "| --- | --- |",
        f"| NaN gradient: (updated, grad norm, weights finite) | {guard['nan_step']}; weights changed: "
        f"{guard['nan_changed']} |",
        f"| good update after it | {guard['good_step'][0]}, grad norm {guard['good_step'][1]:.4g}, weights finite "
        f"{guard['good_step'][2]}; weights changed: {guard['good_changed']} |",
        f"| lr 1e30: (updated, weights finite) | {guard['blown_step']} |",
        f"| the two finiteness checks vs Megatron's optimizer step | {guard['checks_s'] * 1e3:.2f} ms vs "
        f"{guard['step_s'] * 1e3:.2f} ms (ratio {guard['checks_s'] / guard['step_s']:.3f}) |",
        f"| push digest GPU vs CPU ({digest['tensors']} tensors, {digest['values']} values, {digest['dtype']}) | "
        f"relative difference: sum {digest['total_rel']:.3g}, sum of squares {digest['squares_rel']:.3g} "
        f"(tolerance {digest['tolerance']:g}); matches: {digest['matches']} |",
        f"| digest vs one copy of the same tensors | {digest['digest_s'] * 1e3:.2f} ms vs {digest['copy_s'] * 1e3:.2f} "
        f"ms (ratio {digest['digest_s'] / digest['copy_s']:.2f}) |",
    ]
    ok = (guard["nan_step"][0] is False and guard["nan_changed"] == 0 and guard["good_step"][0]
          and guard["good_changed"] > 0 and guard["blown_step"] == (True, False) and digest["matches"])
    lines += ["", f"All checks as expected: {ok}"]
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)
    runtime.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
