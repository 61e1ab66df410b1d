"""The FP8 rollout and R3 checks of benchmarks/gpu_engine.py, on the trainer step of gpu_engine_sync.py.

fp8: model.export_fp8 (bridge/fp8_export.py) pushed through the rollout client into a vLLM server
     that serves block-wise e4m3 weights, beside a BF16 server of the same policy: each engine's
     logprobs against the trainer's, the two engines against each other on the tokens they sampled
     alike (same seeds), and what rl.off_policy's corrections do with the FP8 engine's mismatch.
r3:  rl.routing_replay=rollout: the engine's routed experts of every sample, replayed by the
     trainer; every routed token takes the engine's experts, even after the trainer's routers
     were perturbed so that its own choice differs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gpu_engine_sync import BF16_TOLERANCE, FP32_TOLERANCE, Step, check, generate, precision_of, spread
from route_probe import RouteProbe, perturb_routers

# vLLM loads block-FP8 weights only when every fused piece and TP shard of a linear is whole
# 128-row blocks (bridge/fp8_export.py): the tiny default (hidden 64) is not, so this check runs a
# tiny Qwen3-MoE with 128-aligned linears (3.2M parameters) instead.
FP8_MODEL = {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
             "intermediate_size": 256, "moe_intermediate_size": 128}
OFF_POLICY_METHODS = ("tis", "icepop")


def write_fp8_model(out: Path) -> Path:
    from megatron_rl.model.hf_config import load_hf_config

    raw, _ = load_hf_config("tiny-qwen3-moe")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.json"
    path.write_text(json.dumps({**raw, **FP8_MODEL}, indent=1))
    return path


def check_fp8(device: str, options: dict) -> dict:
    """Two servers on one GPU (FP8 and BF16), each pushed the trainer's weights by files. On CPU the
    same flow runs with the FP8 engine replaced by a second unquantized one (vLLM's CPU build runs
    block FP8 only on Intel AMX CPUs, train/preflight.check_fp8_rollout): only the plumbing is shown."""
    from megatron_rl.config import load_config
    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.rollout.engine_model import write_engine_model_dir

    out = Path(options["out_dir"]) / "fp8"
    on_gpu = device == "cuda"
    precision = precision_of(device)
    base = [f"model.hf_config={write_fp8_model(out / 'model')}", f"model.precision={precision}", "rollout.mode=server",
            "rollout.weight_transport=files", "rollout.gpu_memory_utilization=0.15", "rollout.startup_timeout_s=300",
            "rollout.request_timeout_s=120"]
    step = Step(device, out / "fp8-engine", [*base, f"model.export_fp8={str(on_gpu).lower()}",
                                             f"rollout.staging_dir={out / 'staging-fp8'}"])
    # The BF16 engine: the same run without export_fp8, a second server beside the first.
    reference_config = load_config(None, [f"device={device}", f"output_dir={out / 'bf16-engine'}", "model.layer_spec=local",
                                          "rollout.max_model_len=256", "rollout.weight_bucket_mb=1", *base,
                                          f"rollout.staging_dir={out / 'staging-bf16'}"])
    reference = RolloutClient(reference_config, write_engine_model_dir(reference_config, out / "bf16-engine" / "model"),
                              master_addr=step.runtime.launch.master_addr, local_rank=0, seed=step.config.seed)
    tolerance = BF16_TOLERANCE if precision == "bf16" else FP32_TOLERANCE
    figures = {"model": f"tiny-qwen3-moe with {FP8_MODEL}", "precision": f"{precision} policy",
               "quantization_config": json.loads((step.model_dir / "config.json").read_text()).get("quantization_config")}
    gpu_only = {} if on_gpu else {"FP8 engine": "vLLM's CPU build has block-FP8 kernels only for Intel AMX CPUs "
                                                "(train/preflight.check_fp8_rollout); the dry run's second engine is "
                                                "unquantized, so only the flow is shown"}
    checks = []
    try:
        figures["FP8 server start s"] = round(step.start_engine(), 2)
        figures["FP8 push"] = step.push()
        reference.sync_weights(step.policy.module, step.policy.arch)
        figures["BF16 push"] = {"bytes": reference.last_push_bytes}
        fp8_samples = step.generate(seed=5, max_tokens=32)
        bf16_samples = generate(reference, seed=5, max_tokens=32)
        fp8_vs_trainer = difference_to_trainer(step, fp8_samples)
        bf16_vs_trainer = difference_to_trainer(step, bf16_samples)
        figures["FP8 engine vs trainer"] = spread(fp8_vs_trainer)
        figures["BF16 engine vs trainer"] = spread(bf16_vs_trainer)
        figures["FP8 vs BF16 engine, on the tokens both sampled (same seeds)"] = shared_prefix(fp8_samples, bf16_samples)
        figures["what rl.off_policy does with the FP8 engine's mismatch"] = off_policy_effect(fp8_vs_trainer)
        checks.append(check("BF16 engine vs trainer: max abs diff (the colocated check bound)",
                            figures["BF16 engine vs trainer"]["max"], tolerance["max"]))
        if on_gpu:
            # Reported, not bounded: how far e4m3 weights move the sampling distribution is the
            # figure asked for (a random-init policy's near-uniform distribution understates a
            # trained model's). The FP8 engine must still be the trainer's policy, not noise.
            checks.append(check("FP8 engine vs trainer: mean abs diff below 1 nat (the FP8 engine serves this policy)",
                                figures["FP8 engine vs trainer"]["mean"], 1.0))
            checks.append(check("the FP8 engine is further from the trainer than the BF16 engine (mean abs diff)",
                                figures["FP8 engine vs trainer"]["mean"], figures["BF16 engine vs trainer"]["mean"],
                                ok=figures["FP8 engine vs trainer"]["mean"] > figures["BF16 engine vs trainer"]["mean"]))
    finally:
        reference.shutdown()
        step.close()
    return {"figures": figures, "checks": checks, "gpu_only": gpu_only}


def difference_to_trainer(step: Step, samples) -> list[torch.Tensor]:
    """Per sample, trainer logprob - engine logprob of each response token (log pi_old - log mu)."""
    trainer = step.trainer_logprobs(samples)
    return [ref - torch.tensor(s.logprobs, dtype=torch.float64) for s, ref in zip(samples, trainer)]


def shared_prefix(a_samples, b_samples) -> dict:
    """Two engines sampling with the same seeds draw the same tokens until their distributions
    part: their logprobs on that common prefix are of identical tokens."""
    diffs, shared, total = [], 0, 0
    for a, b in zip(a_samples, b_samples):
        length = 0
        for x, y in zip(a.response_token_ids, b.response_token_ids):
            if x != y:
                break
            length += 1
        total += len(a.response_token_ids)
        shared += length
        if length:
            diffs.append(torch.tensor(a.logprobs[:length], dtype=torch.float64) - torch.tensor(b.logprobs[:length],
                                                                                              dtype=torch.float64))
    figures = {"shared tokens": shared, "of": total}
    if diffs:
        figures.update({f"|diff| {k}": v for k, v in spread(diffs).items() if k != "tokens"})
    return figures


def off_policy_effect(differences: list[torch.Tensor]) -> dict:
    """d = log pi_old - log mu per token: the k3 KL(mu || pi_old) estimate, and per rl.off_policy
    method (its defaults) the share of tokens it truncates or masks and the mismatch it leaves."""
    from megatron_rl.algorithms.from_config import off_policy_overrides
    from megatron_rl.algorithms.offpolicy import truncated_importance_weight
    from megatron_rl.config.rl import OffPolicyConfig

    d = torch.cat(differences)
    valid = torch.ones_like(d, dtype=torch.bool)
    figures = {"tokens": int(d.numel()), "mean |d|": float(d.abs().mean()),
               "k3 KL(mu||pi)": float((torch.expm1(d) - d).mean())}
    for method in OFF_POLICY_METHODS:
        o = off_policy_overrides(OffPolicyConfig(method=method))
        weight = truncated_importance_weight(d, valid, o["tis_level"], o["tis_mode"], o["tis_upper"], o["tis_lower"])
        kept = valid & ~weight.rejected
        figures[method] = {"band": [o["tis_lower"], o["tis_upper"]], "truncated share": float(weight.truncated.double().mean()),
                           "masked share": float(weight.rejected.double().mean()),
                           "mean |d| of the tokens kept": float(d[kept].abs().mean()) if kept.any() else None,
                           "weight mean": float(weight.weight[kept].mean()) if kept.any() else None}
    return figures


# ------------------------------------------------------------------------------------------------
# R3
# ------------------------------------------------------------------------------------------------


def check_r3(device: str, options: dict) -> dict:
    from megatron_rl.model import routing
    from megatron_rl.train.experience import Trajectory, pack_minibatch

    probe = RouteProbe()
    probe.install()
    precision = precision_of(device)
    step = Step(device, Path(options["out_dir"]) / "r3", [f"model.precision={precision}", "rollout.mode=colocated",
                                                           "rl.routing_replay=rollout", "rollout.gpu_memory_utilization=0.3"])
    figures, checks = {"precision": f"{precision} policy and engine"}, []
    try:
        figures["engine start s"] = round(step.start_engine(), 2)
        figures["push"] = step.push()
        samples = step.generate(seed=9, return_routed_experts=True)
        layout = step.engine._route_layout()
        figures["routes from"] = ("vLLM itself (enable_return_routed_experts)" if layout["native"]
                                  else "the worker extension's capture (rollout/worker/route_capture.py)")
        if device == "cuda":  # vLLM 0.26: vllm/config/model.py enable_return_routed_experts, V1 model runner
            checks.append(check("vLLM returns every sample's routed experts itself", 0, 0, ok=layout["native"]))
        arch = step.policy.arch
        expected = [(len(s.prompt_token_ids) + len(s.response_token_ids) - 1, sum(arch.moe_layer_pattern), arch.moe_top_k)
                    for s in samples]
        shapes_ok = [tuple(s.extras["routed_experts"].shape) for s in samples] == expected
        checks.append(check("every sample carries [prompt + response - 1, MoE layers, k] routes", 0, 0, ok=shapes_ok))
        trajectories = [Trajectory(s.prompt_index, s.prompt_token_ids, s.response_token_ids, s.logprobs,
                                   s.finish_reason == "length", 0.0, routed_experts=s.extras["routed_experts"])
                        for s in samples]
        batches = pack_minibatch(trajectories, 128, step.policy.pad_to_multiple)  # several micro-batches
        trace = routing.RouterTrace.attach()
        trace.load_rollout_routes([batches], [trajectories], step.policy.module, arch.moe_layer_pattern)

        trace.start("record")
        figures["engine vs trainer logprobs, trainer's own routes"] = step.mismatch(samples, batches, trace)
        trace.stop()
        same = probe.compare(batches, trace, "record")
        figures["same weights: trainer's own routes differing from the engine's"] = f"{same['own_differ']} of {same['total']}"
        trace.start("rollout")
        figures["engine vs trainer logprobs, R3 (the engine's routes)"] = step.mismatch(samples, batches, trace)
        trace.stop()

        perturb_routers(step.policy.module)  # the trainer's own choice moves away from the engine's
        trace.reset_counts("rollout")
        trace.start("rollout", counter="rollout")
        step.trainer_logprobs(samples, batches, trace)
        trace.stop()
        replayed = probe.compare(batches, trace, "rollout")
        figures["perturbed routers, R3 forward"] = replayed
        checks.append(check("perturbed routers choose other experts on some routed tokens (the check can fail)",
                            replayed["own_differ"], 0, ok=replayed["own_differ"] > 0))
        checks.append(check("R3: routed (token, layer) routes not the engine's", replayed["used_differ"], 0))
        checks.append(check("R3: tokens the engine never ran keep the trainer's own routes",
                            replayed["unrouted"] - replayed["unrouted_kept"], 0))
        checks.append(check("R3 drift counter counts the trainer's own differing routes", 0, 0,
                            ok=list(trace.counts("rollout")) == [replayed["own_differ"], replayed["total"]]))
    finally:
        step.close()
    return {"figures": figures, "checks": checks}
