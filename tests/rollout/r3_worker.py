"""One trainer process checking R3 (rollout routing replay) against a real vLLM engine (CPU build).

    python r3_worker.py --hf HF_DIR --out OUT.json

1. Build the Megatron policy from HF_DIR and start a colocated vLLM engine from the same files.
2. Generate with `return_routed_experts`: every sample carries the engine's routes
   [prompt + response - 1, MoE layers, k] (captured inside the engine, rollout/worker/route_capture.py).
   One long prompt with n=2 makes the second sample's prompt come from vLLM's prefix cache.
3. With the engine's weights, the trainer's own routes agree with the engine's on (nearly) every
   token: evidence that the captured routes are the engine's routing of these very tokens.
4. The trainer's routers are then perturbed, so its own choice differs from the engine's on some
   tokens. A forward recording its own routes, an R3 logprob forward and an R3 training step
   (forward + backward) run on the same packed micro-batches; a probe records the routes each
   forward actually used, per micro-batch and router. OUT.json gets the comparisons.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.bridge import load_hf_weights
from megatron_rl.config import load_config
from megatron_rl.train.experience import Trajectory, pack_minibatch
from megatron_rl.model import routing
from megatron_rl.model.policy import Policy
from megatron_rl.runtime import start_runtime
from megatron_rl.rollout import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from route_probe import RouteProbe, perturb_routers  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    config = load_config(None, ["device=cpu", f"model.hf_config={args.hf}", "optimizer.lr=0.001",
                                f"output_dir={out.parent}"])
    runtime = start_runtime(config)
    probe = RouteProbe()
    probe.install()
    policy = Policy(config, runtime)
    load_hf_weights(policy.module, policy.arch, args.hf)
    policy.optimizer.reload_model_params()
    trace = routing.RouterTrace.attach()

    from megatron_rl.rollout.engines.vllm_colocated import VllmColocatedEngine

    engine = VllmColocatedEngine(args.hf, dtype="float32", max_model_len=256, seed=0)
    report: dict = {}
    try:
        long_prompt = [3 + (17 * i) % 200 for i in range(150)]  # more than one KV block (128 on CPU)
        prompts = [[3, 17, 99, 250, 7], [42, 211, 5], long_prompt, [180, 64, 128, 2, 77, 199]]
        groups = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=7,
                                                         return_routed_experts=True))
    finally:
        engine.shutdown()
    samples = [sample for group in groups for sample in group]
    report["shapes_ok"] = all(
        tuple(s.extras["routed_experts"].shape) == (len(s.prompt_token_ids) + len(s.response_token_ids) - 1,
                                                    sum(policy.arch.moe_layer_pattern), policy.arch.moe_top_k)
        for s in samples)
    shared = groups[2]
    report["prefix_routes_shared"] = torch.equal(shared[0].extras["routed_experts"][:150],
                                                 shared[1].extras["routed_experts"][:150])
    trajectories = [Trajectory(s.prompt_index, s.prompt_token_ids, s.response_token_ids, s.logprobs,
                               s.finish_reason == "length", 0.0, routed_experts=s.extras["routed_experts"])
                    for s in samples]
    batches = pack_minibatch(trajectories, 96, policy.pad_to_multiple)  # several micro-batches
    trace.load_rollout_routes([batches], [trajectories], policy.module, policy.arch.moe_layer_pattern)
    report["microbatches"] = len(batches)
    report["moe_layers"] = trace._moe_layer

    def own_routes() -> dict:
        trace.start("record")
        policy.logprobs(batches, with_entropy=False, routing=trace)
        trace.stop()
        return probe.compare(batches, trace, "record")

    # The engine's weights: the trainer's own routes are the engine's, up to near-ties.
    report["same_weights"] = own_routes()

    # The trainer's routers move away from the engine's: its own choice now differs on some tokens.
    perturb_routers(policy.module)
    report["perturbed_own"] = own_routes()

    trace.reset_counts("rollout")
    trace.start("rollout", counter="rollout")
    policy.logprobs(batches, with_entropy=False, routing=trace)
    trace.stop()
    report["r3_logprobs"] = probe.compare(batches, trace, "rollout")
    report["rollout_counts"] = list(trace.counts("rollout"))

    trace.reset_counts()
    trace.start("rollout")
    normalizer = max(1.0, float(sum(b.loss_mask.sum() for b in batches)))
    policy.train_step(batches, lambda lp, ent, b: (-(lp * b.loss_mask[0]).sum() / normalizer, {}), routing=trace)
    trace.stop()
    report["r3_train"] = probe.compare(batches, trace, "rollout")
    report["train_counts"] = list(trace.counts())
    if dist.get_rank() == 0:
        out.write_text(json.dumps(report, indent=1))
    dist.barrier()
    runtime.shutdown()


if __name__ == "__main__":
    main()
