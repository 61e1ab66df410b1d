"""A layout's training time per RL step from a measured per-GPU step time (`plan --measured`).

A layout uses a measurement (plan/measured.py) when its per-GPU shape has the measurement's key:
the planned GPU, the model's decoder layer, experts / EP local experts, TP, expert TP, CP,
sequence parallelism, the micro-batch's tokens on the GPU and the speed settings. Then

    micro-batch time of a stage = micro-batch tokens x (its layers x layer s/token
                                                         + head s/token on the last stage)
    one update                  = (m + pp - 1) x the slowest stage's micro-batch time
                                  (1F1B: m micro-batches per DP rank, pp - 1 slots of fill and
                                  drain, so the bubble is (pp - 1) / (m + pp - 1) of it)
    m                           = ceil(tokens per update / (DP x micro_batch_tokens))
    training time per RL step   = rl.updates_per_rollout x one update

over the step's tokens (--step-tokens; default rl.prompts_per_step x rl.group_size x
rollout.max_model_len: every sample at full length, an upper bound). Not in it: communication
(pipeline sends, TP and the EP all-to-all, the DP gradient reduction), the optimizer step, the
old-logprob forward and the weight push (its own column). It ranks layouts whose per-GPU work is
the measured one; it is not a performance model of the rest.
"""

from __future__ import annotations

import dataclasses
import json
import math

from megatron_rl.errors import ConfigError
from megatron_rl.plan.measured import CPU_DRY_RUN, MeasuredTable, Measurement, layer_identity, step_settings


@dataclasses.dataclass(frozen=True)
class Selection:
    """What of a table a plan uses: its measurements of the planned model on the planned GPU."""

    table: MeasuredTable
    gpu: str
    gpu_from: str
    of_model: tuple  # Measurement
    step_tokens: int
    step_tokens_from: str


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    seconds: float  # training time per RL step
    micro_batches: int  # per DP rank per update
    bubble: float  # of each update
    stage_seconds: tuple  # one micro-batch's forward + backward on each stage
    measurement: Measurement
    source: str  # "FILE line N"


def default_step_tokens(config) -> int:
    return config.rl.prompts_per_step * config.rl.group_size * config.rollout.max_model_len


def select(table: MeasuredTable, config, arch, gpu_name: str | None, step_tokens: int | None) -> Selection:
    """The table's measurements this plan can use; refused by name when none can."""
    where = f"--measured {table.path}"
    gpus = table.gpus()
    if gpu_name is not None:
        gpu = next((g for g in gpus if g.casefold() == gpu_name.strip().casefold()), None)
        if gpu is None:
            raise ConfigError(f"{where} holds measurements on {', '.join(gpus)}, none on --gpu-name {gpu_name!r}; "
                              "plan for a GPU it measured, or measure this one (benchmarks/moe_perf.py)")
        gpu_from = "--gpu-name"
    elif len(gpus) > 1:
        raise ConfigError(f"{where} holds measurements on {len(gpus)} GPUs ({', '.join(gpus)}): name the one "
                          "planned with --gpu-name")
    else:
        gpu, gpu_from = gpus[0], "the table's only GPU; --gpu-name to name it"
    on_gpu = [m for m in table.measurements if m.gpu == gpu]
    if gpu == CPU_DRY_RUN:
        raise ConfigError(f"{where} line {on_gpu[0].line}: measured by a CPU dry run, not on a GPU: its figures are "
                          "the pipeline's, not a step time to plan with")
    if not arch.is_moe or not all(arch.moe_layer_pattern):
        dense = arch.num_layers - sum(arch.moe_layer_pattern) if arch.is_moe else arch.num_layers
        raise ConfigError(f"{where}: {arch.architecture} has {dense} dense layer(s); the table times MoE layers, so "
                          "no layout of it has a measured step time (drop --measured)")
    identity = layer_identity(arch)
    of_model = tuple(m for m in on_gpu if m.layer == identity)
    if not of_model:
        first = on_gpu[0]
        differ = [f"{name} {first.layer.get(name)!r} (the model's {value!r})" for name, value in identity.items()
                  if first.layer.get(name) != value]
        raise ConfigError(f"{where}: none of its {len(on_gpu)} measurement(s) on {gpu} is of {arch.architecture}'s "
                          f"layer (line {first.line}: {', '.join(differ)}); measure this model's layer "
                          "(benchmarks/moe_perf.py) or drop --measured")
    if step_tokens is not None and not 1 <= step_tokens <= 1 << 50:
        raise ConfigError(f"--step-tokens must be from 1 to {1 << 50} (tokens one RL step trains), got {step_tokens}")
    tokens_from = "--step-tokens" if step_tokens is not None else \
        "rl.prompts_per_step x rl.group_size x rollout.max_model_len, every sample at full length; --step-tokens to set"
    return Selection(table, gpu, gpu_from, of_model, step_tokens or default_step_tokens(config), tokens_from)


def layout_key(config, arch, parallel, gpu: str) -> dict:
    """The measurement key of one GPU of this layout (plan/measured.py KEY)."""
    return {"gpu": gpu, "layer": layer_identity(arch), "local_experts": arch.num_experts // parallel.ep,
            "tp": parallel.tp, "etp": parallel.expert_tp, "cp": parallel.cp,
            "micro_batch_tokens": config.micro_batch_tokens // parallel.cp,
            "sequence_parallel": parallel.uses_sequence_parallel, "settings": step_settings(config)}


def estimate(layout, config, arch, selection: Selection) -> StepEstimate | None:
    """The layout's training time per RL step from its measurement, or None when none has its key."""
    p = layout.parallel
    found = selection.table.find(layout_key(config, arch, p, selection.gpu))
    if found is None:
        return None
    updates = config.rl.updates_per_rollout
    per_update = math.ceil(selection.step_tokens / updates)
    micro = math.ceil(per_update / (layout.dp * config.micro_batch_tokens))
    tokens = config.micro_batch_tokens // p.cp
    head = found.head_seconds_per_token or 0.0  # None: the head is inside the layer figure
    stages = tuple(tokens * (s.layers * found.layer_seconds_per_token + (head if s.stage == p.pp - 1 else 0.0))
                   for s in layout.stages)
    seconds = updates * (micro + p.pp - 1) * max(stages)
    return StepEstimate(seconds, micro, (p.pp - 1) / (micro + p.pp - 1), stages, found,
                        f"{selection.table.path.name} line {found.line}")


def unmatched(selection: Selection, config, arch, layouts: list) -> list[str]:
    """Why each of the model's measurements timed no layout of this plan (the first difference)."""
    used = {layout.step.measurement.line for layout in layouts if layout.step is not None}
    settings = step_settings(config)
    notes = []
    for m in selection.of_model:
        if m.line in used:
            continue
        line = json.loads(m.key)
        if line["micro_batch_tokens"] != config.micro_batch_tokens:
            why = f"micro_batch_tokens {line['micro_batch_tokens']} (the config's {config.micro_batch_tokens})"
        else:
            differ = [f"{k} {v!r} (the config's {settings[k]!r})" for k, v in line["settings"].items() if settings[k] != v]
            why = ", ".join(differ) or (
                f"no layout planned has EP {arch.num_experts // line['local_experts']} ({line['local_experts']} local "
                f"experts) with tp {line['tp']}, etp {line['etp']}, cp {line['cp']}")
        notes.append(f"line {m.line} timed no layout: {why}")
    return notes
