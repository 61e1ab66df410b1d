"""The planner's side of the checks, in a process of its own (it sets up a fake process group and
Megatron's parallel state, which are process-wide).

    python plan_worker.py predict OUT.json MODEL WORLD [key=value ...]
        per global rank: the bytes the planner says it holds (params, grads, main_params, moments)
    python plan_worker.py compose OUT.json
        per case: the parameter count of whole stages built on meta vs the planner's composition
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path


def predict(model: str, world: int, overrides: list[str]) -> dict:
    from megatron.core.parallel_state import RankGenerator

    from megatron_rl.config import load_config
    from megatron_rl.model.hf_config import load_hf_config, parse_hf_config
    from megatron_rl.plan.meta_model import layer_kinds, probe_parameters, stage_layer_counts
    from megatron_rl.plan.state_bytes import stage_states

    config = load_config(None, ["device=cpu", f"model.hf_config={model}", *overrides])
    arch = parse_hf_config(*load_hf_config(model))
    p = config.parallel
    dp, expert_dp = world // (p.tp * p.pp * p.cp), world // (p.expert_tp * p.ep * p.pp)
    probe = probe_parameters(arch, config, p.tp, p.ep, p.expert_tp)
    kinds, start, stages = layer_kinds(arch), 0, []
    for stage, count in enumerate(stage_layer_counts(arch.num_layers, p)):
        params = probe.stage(kinds[start:start + count], first=stage == 0, last=stage == p.pp - 1, pp=p.pp)
        start += count
        stages.append(stage_states(params, dp=dp * p.cp, expert_dp=expert_dp,
                                   distributed_optimizer=p.distributed_optimizer))
    # Which stage and DP ranks each global rank has: Megatron's own rank generators.
    dense = RankGenerator(tp=p.tp, ep=1, dp=dp, pp=p.pp, cp=p.cp, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=p.expert_tp, ep=p.ep, dp=expert_dp, pp=p.pp, cp=1, order="tp-cp-ep-dp-pp")
    where: dict[int, dict] = {r: {} for r in range(world)}
    for group in dense.get_ranks("pp"):
        for index, rank in enumerate(group):
            where[rank]["stage"] = index
    for group in dense.get_ranks("dp-cp"):
        for index, rank in enumerate(group):
            where[rank]["dp_rank"] = index
    for group in expert.get_ranks("dp"):
        for index, rank in enumerate(group):
            where[rank]["expert_dp_rank"] = index
    out = {}
    for rank, w in where.items():
        state = stages[w["stage"]].rank(w["dp_rank"], w["expert_dp_rank"])
        out[rank] = {**dataclasses.asdict(state), **w}
    return out


def compose() -> dict:
    """Whole stages built on meta against the planner's composition of probe pieces."""
    from megatron_rl.config import load_config
    from megatron_rl.model.hf_config import load_hf_config, parse_hf_config
    from megatron_rl.plan.meta_model import build_on_meta, layer_kinds, probe_parameters, stage_layer_counts

    cases = [("deepseek-v3", 256, ["parallel.tp=8", "parallel.pp=4", "parallel.ep=64", "parallel.etp=1",
                                   "parallel.pp_last_stage_layers=13", "model.precision=bf16"]),
             ("glm-4.5", 64, ["parallel.tp=8", "parallel.pp=4", "parallel.ep=16", "parallel.etp=1",
                              "model.precision=bf16"]),
             ("tiny-qwen3", 2, ["parallel.pp=2"]),  # tied embeddings across stages
             ("tiny-deepseek-v3", 4, ["parallel.tp=2", "parallel.ep=2", "parallel.etp=1"])]
    results = {}
    for model, world, overrides in cases:
        config = load_config(None, ["device=cpu", f"model.hf_config={model}", *overrides])
        arch = parse_hf_config(*load_hf_config(model))
        p = config.parallel
        probe = probe_parameters(arch, config, p.tp, p.ep, p.expert_tp)
        kinds, start = layer_kinds(arch), 0
        for stage, count in enumerate(stage_layer_counts(arch.num_layers, p)):
            composed = probe.stage(kinds[start:start + count], first=stage == 0, last=stage == p.pp - 1, pp=p.pp)
            start += count
            whole = build_on_meta(arch, config, world, stage=stage)
            built = [(name, param.numel(), not getattr(param, "allreduce", True))
                     for name, param in whole.named_parameters()]
            results[f"{model}/stage{stage}"] = {
                "built": [n for _, n, _ in built], "composed": [e.numel for e in composed],
                "built_expert": sum(n for _, n, e in built if e), "composed_expert": sum(e.numel for e in composed if e.expert),
                "built_shared": sum(1 for _, param in whole.named_parameters() if getattr(param, "shared_embedding", False)),
                "composed_shared": sum(1 for e in composed if e.shared_embedding),
            }
    return results


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "predict":
        result = predict(sys.argv[3], int(sys.argv[4]), sys.argv[5:])
    else:
        result = compose()
    out.write_text(json.dumps(result))
