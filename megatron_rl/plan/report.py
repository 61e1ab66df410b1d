"""The planner's output: a table read at a glance, JSON for scripts, and the chosen layout's
overrides for `megatron-rl launch slurm`."""

from __future__ import annotations

import math

from megatron_rl.plan.planner import GIB, LayoutPlan, Plan


def _gib(value: int) -> str:
    return f"{value / GIB:.1f}"


def layout_name(p) -> str:
    text = f"tp{p.tp} pp{p.pp} ep{p.ep} etp{p.expert_tp}" + (f" cp{p.cp}" if p.cp > 1 else "")
    return text + (f" (last stage {p.pp_last_stage_layers})" if p.pp_last_stage_layers else "")


HEADER = ("layout", "dp", "params", "grads", "optim", "activ", "engine", "kv", "left", "push GB", "push s", "fits")
RANKED_BY = "ranked by"  # the last column with --measured: which rule placed the layout


def row(layout: LayoutPlan, plan: Plan | None = None) -> tuple[str, ...]:
    stage = layout.fullest
    cells = (layout_name(layout.parallel), str(layout.dp), _gib(stage.state.params), _gib(stage.state.grads),
             _gib(stage.state.optimizer), _gib(stage.activations), _gib(layout.engine_weights),
             _gib(max(layout.kv_cache, 0)), _gib(layout.left), f"{layout.push_bytes / 1e9:.1f}",
             f"{layout.push_seconds:.2f}", "yes" if layout.fits else "no")
    return cells if plan is None or plan.measured is None else (*cells, ranked_by(layout))


def ranked_by(layout: LayoutPlan) -> str:
    """Which rule placed the layout: its measured step time (and from where), memory, or the heuristic."""
    if layout.step is not None:
        text = f"measured: {layout.step.seconds:,.1f} s from {layout.step.source}"
        return text if layout.fits else f"does not fit ({text})"
    return "heuristic" if layout.fits else "does not fit"


def table(rows: list[tuple[str, ...]]) -> str:
    header = HEADER + (RANKED_BY,) * (len(rows[0]) - len(HEADER) if rows else 0)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i in (0, len(HEADER)) else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in [header, *rows]]
    return "\n".join([lines[0], "-" * max(map(len, lines)), *lines[1:]])


def launch_overrides(config, layout: LayoutPlan, cluster) -> str:
    """The `megatron-rl launch slurm` arguments that run this layout."""
    p = layout.parallel
    nodes = max(1, cluster.gpus // cluster.gpus_per_node)
    parts = [f"--nodes {nodes}", f"--gpus-per-node {min(cluster.gpus, cluster.gpus_per_node)}"]
    if cluster.rollout_gpus:
        parts.append(f"--rollout-nodes {math.ceil(cluster.rollout_gpus / cluster.gpus_per_node)}")
    parts += [f"parallel.tp={p.tp}", f"parallel.pp={p.pp}", f"parallel.ep={p.ep}", f"parallel.etp={p.expert_tp}"]
    if p.cp > 1:
        parts.append(f"parallel.cp={p.cp}")
    parts.append(f"parallel.pp_last_stage_layers={p.pp_last_stage_layers if p.pp_last_stage_layers else 'null'}")
    parts.append("parallel.pp_first_stage_layers=null")
    parts.append(f"model.recompute={config.model.recompute}")
    if cluster.rollout_gpus:
        parts.append("rollout.mode=server")
    return " ".join(parts)


def describe(config, arch, plan: Plan, *, source: str, top: int, own: LayoutPlan | None, fix: str | None) -> str:
    cluster = plan.cluster
    placement = ("engines colocated on the trainer GPUs" if cluster.colocated else
                 f"rollout servers of {config.rollout.server_tp} GPUs on "
                 + (f"{cluster.rollout_gpus} GPUs" if cluster.rollout_gpus else "GPUs") + " of their own")
    lines = [
        f"{arch.architecture} from {source}: {arch.num_layers} layers, hidden {arch.hidden_size}"
        + (f", {arch.num_experts} experts top-{arch.moe_top_k}" if arch.is_moe else ""),
        f"{cluster.gpus} trainer GPUs ({cluster.gpus_per_node} per node, {cluster.gpu_memory / GIB:.0f} GiB each), "
        + (f"rollout GPUs of {cluster.rollout_gpu_memory / GIB:.0f} GiB, "
           if cluster.rollout_gpu_memory and not cluster.colocated else "")
        + f"{placement}; micro-batch {config.micro_batch_tokens} tokens, {config.model.precision}"
        + (f" + FP8 {config.model.fp8_recipe}" if config.model.fp8_recipe else "")
        + f", distributed optimizer {'on' if config.parallel.distributed_optimizer else 'off'}, "
        f"recompute {config.model.recompute}, gpu_memory_utilization {config.rollout.gpu_memory_utilization}",
        "GiB per GPU on the fullest stage; params/grads/optim exact from the Megatron model on the meta device, "
        "activations estimated (micro-batches in flight x one micro-batch); engine = its weights per GPU; "
        f"push at NVLink {cluster.nvlink_gbs:g} GB/s (colocated) or InfiniBand "
        f"{cluster.ib_gbs_per_node:g} GB/s per node (one NIC per sending GPU).",
        "",
    ]
    if plan.measured is not None:
        lines[-1:-1] = measured_lines(config, arch, plan)
    shown = plan.layouts[:top]
    lines.append(table([row(layout, plan) for layout in shown]))
    fitting = len(plan.fitting)
    lines.append(f"\n{fitting} of {plan.considered} layouts preflight accepts fit; ranked by: {', '.join(plan.ranking)}"
                 + (f"; showing {len(shown)} (--top)" if len(shown) < plan.considered else ""))
    if own is not None:
        lines.append(f"\nThe config's layout ({layout_name(own.parallel)}): "
                     + ("fits" if own.fits else "does NOT fit") + f", {_gib(own.left)} GiB left per GPU"
                     + (f"; measured: {own.step.seconds:,.1f} s per RL step from {own.step.source}" if own.step else "")
                     + ".")
        if not own.fits:
            lines.append(_why(own) + (f" Smallest change that fits: {fix}." if fix else
                                      " No single change (recompute, distributed optimizer, 2x EP, 2x PP, half "
                                      "the micro-batch) makes it fit: choose a layout above or add GPUs."))
    if plan.fitting:
        best = plan.fitting[0]
        lines.append(f"\nBest: {layout_name(best.parallel)}. To launch it:\n  megatron-rl launch slurm --config "
                     f"CONFIG {launch_overrides(config, best, cluster)}")
    else:
        largest = plan.layouts[0] if plan.layouts else None
        if largest is not None:
            lines.append("\nNo layout fits. " + _why(largest))
    return "\n".join(lines)


def _why(layout: LayoutPlan) -> str:
    if not layout.engine_fits:
        return (f"The engine's weights ({_gib(layout.engine_weights)} GiB per GPU) leave no KV cache inside "
                f"rollout.gpu_memory_utilization ({_gib(layout.engine_budget)} GiB): raise it, or give the engines "
                "more GPUs (--rollout-gpus, rollout.server_tp).")
    name, value = next(iter(layout.consumers().items()))
    return (f"It needs {_gib(layout.trainer_bytes)} GiB for training on its fullest stage (stage "
            f"{layout.fullest.stage}) of {_gib(layout.trainer_budget)} GiB; the largest consumer is {name} "
            f"({_gib(value)} GiB).")


def as_json(config, arch, plan: Plan, own: LayoutPlan | None, fix: str | None) -> dict:
    def layout_dict(layout: LayoutPlan) -> dict:
        p = layout.parallel
        return {
            "tp": p.tp, "pp": p.pp, "ep": p.ep, "etp": p.expert_tp, "cp": p.cp,
            "pp_last_stage_layers": p.pp_last_stage_layers, "dp": layout.dp, "expert_dp": layout.expert_dp,
            "fits": layout.fits, "left_bytes": layout.left, "trainer_budget_bytes": layout.trainer_budget,
            "stages": [{"stage": s.stage, "layers": s.layers, "params_bytes": s.state.params,
                        "grads_bytes": s.state.grads, "main_params_bytes": s.state.main_params,
                        "moments_bytes": s.state.moments, "activations_bytes": s.activations,
                        "micro_batches_in_flight": s.in_flight, "push_bytes": s.push_bytes} for s in layout.stages],
            "engine_weights_bytes": layout.engine_weights, "kv_cache_bytes": layout.kv_cache,
            "kv_cache_tokens": layout.kv_tokens, "push_seconds": layout.push_seconds,
            "launch": launch_overrides(config, layout, plan.cluster),
            **({"step_time": step_json(layout)} if plan.measured is not None else {}),
        }

    return {
        "model": arch.architecture, "cluster": plan.cluster.__dict__, "ranking": list(plan.ranking),
        **({"measured": measured_json(plan)} if plan.measured is not None else {}),
        "layouts": [layout_dict(layout) for layout in plan.layouts],
        "config_layout": None if own is None else {**layout_dict(own), "smallest_fix": fix},
    }


HEADER_BEGIN = "# ---- planned with: megatron-rl plan "
HEADER_END = "# ---- end of plan"


def recipe_header(config, plan: Plan, own: LayoutPlan | None, command: str, top: int) -> str:
    """The plan as a recipe's header comment: the command that made it, the best layouts and the
    recipe's own (tests/config/test_recipes.py re-runs the command and compares)."""
    rows = [row(layout, plan) for layout in plan.layouts[:top]]
    if own is not None and own.parallel not in [layout.parallel for layout in plan.layouts[:top]]:
        rows.append(row(own, plan))
    lines = [HEADER_BEGIN + command,
             f"# GiB per GPU ({plan.cluster.gpu_memory / GIB:.0f} GiB GPUs"
             + (f", rollout {plan.cluster.rollout_gpu_memory / GIB:.0f} GiB" if plan.cluster.rollout_gpu_memory else "")
             + ") on the fullest pipeline stage; "
             f"{len(plan.fitting)} of {plan.considered} layouts fit; the first {min(top, plan.considered)} as ranked"
             + (", then this recipe's" if own is not None and len(rows) > top else "") + ":"]
    lines += ["#   " + line for line in table(rows).splitlines()]
    if own is not None:
        lines.append(f"# This recipe: {layout_name(own.parallel)}, " + ("fits" if own.fits else "DOES NOT FIT")
                     + f" ({_gib(own.left)} GiB left per GPU).")
    lines.append(HEADER_END)
    return "\n".join(lines)


def measured_lines(config, arch, plan: Plan) -> list[str]:
    """What --measured adds above the table: the table used, how its figure becomes a step time,
    and why a measurement of this model timed no layout."""
    from megatron_rl.plan.step_time import unmatched

    selection = plan.measured
    timed = sum(1 for layout in plan.layouts if layout.step is not None)
    lines = [f"Measured step times: {selection.table.path} ({selection.gpu}: {selection.gpu_from}), "
             f"{len(selection.of_model)} measurement(s) of this model's layer; {timed} of {plan.considered} layouts "
             "have one; those that fit are reordered by it among their own places.",
             "measured = training time per RL step: rl.updates_per_rollout x (m + pp - 1) micro-batch slots of the "
             "slowest stage (its layers x the measured layer time per token + the head on the last stage, x "
             "micro_batch_tokens), m = micro-batches per DP rank per update,",
             f"over {selection.step_tokens:,} tokens per step ({selection.step_tokens_from}); communication, the "
             "optimizer step and the old-logprob pass are not in it."]
    notes = {m.line: m.note for layout in plan.layouts if layout.step is not None
             for m in [layout.step.measurement] if m.note}
    lines += [f"  line {line}: {note}" for line, note in sorted(notes.items())]
    lines += [f"  {text}" for text in unmatched(selection, config, arch, plan.layouts)]
    return lines


def step_json(layout: LayoutPlan) -> dict:
    if layout.step is None:
        return {"rule": "heuristic" if layout.fits else "does not fit"}
    step = layout.step
    return {"rule": "measured" if layout.fits else "does not fit", "seconds_per_rl_step": step.seconds,
            "micro_batches_per_update": step.micro_batches, "bubble": step.bubble,
            "stage_micro_batch_seconds": list(step.stage_seconds), "source": step.source,
            "runs": list(step.measurement.runs), "note": step.measurement.note}


def measured_json(plan: Plan) -> dict:
    selection = plan.measured
    return {"table": str(selection.table.path), "gpu": selection.gpu, "step_tokens": selection.step_tokens,
            "lines_of_this_model": [m.line for m in selection.of_model]}
