"""`megatron-rl plan`: every parallel layout preflight accepts for a model on a cluster, what each
holds per GPU, and which ones fit.

    plan = plan_layouts(config, arch, Cluster(gpus=256))
    plan.fitting[0]                   # the best-ranked layout that fits (LayoutPlan)
    evaluate(config, arch, cluster)   # the config's own layout

Per GPU, for the fullest rank of each layout (the most loaded pipeline stage and DP rank):
training state exactly (plan/meta_model.py + plan/state_bytes.py), activations of the micro-batches
the 1F1B schedule keeps in flight on that stage (plan/activations.py), and the rollout engine: with
colocated engines (rollout.mode colocated: one engine over all trainer GPUs) its share of the
weights and the KV cache inside rollout.gpu_memory_utilization of every GPU; with rollout GPUs of
their own, each server's weights and KV cache on its rollout.server_tp GPUs. Plus the weight push
after every step: each pipeline stage's leader sends its stage's weights in the engines' dtype
(block FP8 with model.export_fp8) over NVLink (colocated) or its node's InfiniBand share (one NIC
per GPU: ib_gbs_per_node / gpus_per_node), all stages at once.

Ranking among the layouts that fit (a heuristic stated in `RANKING`, not a performance model):
those leaving at least 10% of the GPU (for what is not modelled: CUDA context, NCCL buffers,
fragmentation), then fewer pipeline stages (the 1F1B bubble), then tensor parallelism within a node
and smaller, then expert groups within a node, then the shorter weight push, then the most memory
left. With `--measured FILE` (plan/step_time.py) the layouts whose per-GPU shape was timed on the
GPU are then reordered among the places the heuristic gave them (within the same headroom tier),
by their estimated training time per RL step: the ranking changes only where a measurement exists,
and a measured time is never weighed against a layout nobody timed.
"""

from __future__ import annotations

import dataclasses
import math

from megatron_rl.errors import ConfigError
from megatron_rl.plan import activations as act
from megatron_rl.plan.meta_model import layer_kinds, probe_parameters, stage_layer_counts
from megatron_rl.plan.state_bytes import RankState, stage_states

GIB = 1024**3
# The largest cluster `plan` reasons about: 2^20 GPUs (a million; today's largest jobs hold ~10^5),
# 2^12 per node (NVLink domains hold 72 .. 576), 2^50 bytes of memory per GPU. Beyond them a flag
# is a typo, and the layout search (divisors of the GPU count, per layer and expert) only wastes time.
MAX_GPUS = 1 << 20
MAX_GPUS_PER_NODE = 1 << 12
MAX_GPU_MEMORY = 1 << 50
HEADROOM = 0.1  # of GPU memory, for what is not modelled: CUDA context, NCCL buffers, fragmentation
RANKING = ("fits", f"at least {HEADROOM:.0%} of the GPU left", "fewer pipeline stages",
           "tensor parallel within a node, smaller", "expert group within a node",
           "shorter weight push", "more memory left")
MEASURED_RANKING = (*RANKING, "then the layouts with a measured step time reordered among their own places by "
                                "it, shortest first (the rest keep theirs)")


@dataclasses.dataclass(frozen=True)
class Cluster:
    gpus: int  # trainer GPUs
    gpus_per_node: int = 8
    gpu_memory: int = 80 * GIB
    rollout_gpu_memory: int | None = None  # the rollout servers' GPUs (None: as the trainer's)
    rollout_gpus: int = 0  # GPUs of the rollout servers (0: not given)
    colocated: bool = True  # engines inside the trainer processes (rollout.mode colocated), else servers
    nvlink_gbs: float = 450.0  # GB/s one way per GPU (H100 NVLink 4: 900 GB/s both ways)
    ib_gbs_per_node: float = 400.0  # GB/s per node (8 x 400 Gb/s NICs)

    def validate(self) -> "Cluster":
        limits = {"gpus": MAX_GPUS, "gpus_per_node": MAX_GPUS_PER_NODE, "gpu_memory": MAX_GPU_MEMORY}
        for name, limit in limits.items():
            if not 1 <= getattr(self, name) <= limit:
                raise ConfigError(f"--{name.replace('_', '-')} must be from 1 to {limit}, got {getattr(self, name)}")
        if not 0 <= self.rollout_gpus <= MAX_GPUS:
            raise ConfigError(f"--rollout-gpus must be from 0 to {MAX_GPUS}, got {self.rollout_gpus}")
        if self.rollout_gpu_memory is not None and not 1 <= self.rollout_gpu_memory <= MAX_GPU_MEMORY:
            raise ConfigError(f"--rollout-gpu-memory must be from 1 to {MAX_GPU_MEMORY}, got {self.rollout_gpu_memory}")
        for name in ("nvlink_gbs", "ib_gbs_per_node"):  # the push time divides by them
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"--{name.replace('_', '-')} must be a bandwidth above 0 GB/s, got {value}")
        if self.colocated and self.rollout_gpus:
            raise ConfigError("--rollout-gpus gives the engines GPUs of their own: not with colocated engines")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ConfigError(f"--gpus {self.gpus} is not a whole number of nodes of --gpus-per-node "
                              f"{self.gpus_per_node}")
        return self


@dataclasses.dataclass(frozen=True)
class StagePlan:
    stage: int
    layers: int
    state: RankState  # the stage's fullest DP rank
    activations: int  # bytes of the micro-batches in flight on this stage
    in_flight: int
    push_bytes: int  # the stage's weights as the engines receive them


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
    parallel: object  # ParallelConfig
    dp: int
    expert_dp: int
    stages: tuple[StagePlan, ...]
    engine_weights: int  # per GPU that holds an engine (colocated: every trainer GPU)
    kv_cache: int  # per engine GPU
    kv_tokens: int  # tokens of KV cache per engine (at max_model_len: kv_tokens // max_model_len sequences)
    engine_budget: int  # rollout.gpu_memory_utilization x GPU memory, on GPUs that hold an engine
    trainer_budget: int  # what the trainer may use on its GPUs
    push_seconds: float
    gpu_memory: int
    step: object = None  # step_time.StepEstimate where a measurement times this layout (plan --measured)

    @property
    def fullest(self) -> StagePlan:
        return max(self.stages, key=lambda s: s.state.total + s.activations)

    @property
    def trainer_bytes(self) -> int:
        stage = self.fullest
        return stage.state.total + stage.activations

    @property
    def left(self) -> int:
        return self.trainer_budget - self.trainer_bytes

    @property
    def engine_fits(self) -> bool:
        return self.kv_cache > 0

    @property
    def fits(self) -> bool:
        return self.left >= 0 and self.engine_fits

    @property
    def push_bytes(self) -> int:
        return max(s.push_bytes for s in self.stages)

    def consumers(self) -> dict[str, int]:
        """Per GPU of the fullest stage, largest first."""
        stage = self.fullest
        parts = {"parameters": stage.state.params, "gradients": stage.state.grads,
                 "optimizer state": stage.state.optimizer, "activations": stage.activations}
        if self.trainer_budget < self.gpu_memory:  # colocated: the engine's reservation
            parts["colocated engine (gpu_memory_utilization)"] = self.gpu_memory - self.trainer_budget
        return dict(sorted(parts.items(), key=lambda kv: -kv[1]))

    def sort_key(self, cluster: Cluster):
        p = self.parallel
        if not self.fits:  # those whose engines fit, then the nearest to fitting
            return (1, not self.engine_fits, -self.left)
        return (0, self.low_headroom, p.pp, p.tp > cluster.gpus_per_node, p.tp,
                p.ep * p.expert_tp > cluster.gpus_per_node,
                round(self.push_seconds, 1), -self.left)

    @property
    def low_headroom(self) -> bool:
        return self.left < HEADROOM * self.gpu_memory


def _itemsize(config) -> int:
    return 2 if config.model.precision == "bf16" else 4


def _export_bytes(params, config) -> int:
    """Bytes the engines receive for these (unsharded) parameters."""
    fp32 = config.rollout.dtype == "float32" or (config.rollout.dtype == "auto" and config.model.precision == "fp32")
    engine = 4 if fp32 else 2
    total = 0
    for p in params:
        if config.model.export_fp8 and p.fp8_served:
            total += p.numel + 4 * math.ceil(p.numel / (128 * 128))  # e4m3 + one fp32 scale per 128x128 block
        else:
            total += p.numel * engine
    return total


@dataclasses.dataclass(frozen=True)
class _PushBytes:
    """Bytes a pipeline stage pushes to the engines, by piece. A stage's parameters are the probe's
    pieces one after the other (meta_model.ProbeParameters.stage), so its bytes are the sum of
    theirs: counted once per piece instead of once per parameter of every stage of every layout
    (a 256-GPU DeepSeek-V3 search went through over 12 million parameter entries that way)."""

    first: int  # what only the first stage holds (the embedding)
    layer: dict  # layer kind -> one layer's
    last: int  # what only the last stage holds (final norm, output layer)

    @classmethod
    def of(cls, full, config, pp: int) -> "_PushBytes":
        return cls(_export_bytes(full.stage([], first=True, last=False, pp=pp), config),
                   {kind: _export_bytes(full.stage([kind], first=False, last=False, pp=pp), config)
                    for kind in full.layers},
                   _export_bytes(full.stage([], first=False, last=True, pp=pp), config))

    def stage(self, kinds: list[str], *, first: bool, last: bool) -> int:
        return (self.first if first else 0) + sum(self.layer[kind] for kind in kinds) + (self.last if last else 0)


def kv_bytes_per_token(arch, itemsize: int, tp: int) -> int:
    """KV cache per token per GPU of an engine of tensor parallel size tp (MLA caches its latent)."""
    if arch.mla is not None:
        return arch.num_layers * (arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim) * itemsize
    heads = max(1, arch.num_key_value_heads // tp)
    return arch.num_layers * 2 * heads * arch.head_dim * itemsize


def evaluate(config, arch, cluster: Cluster) -> LayoutPlan:
    """The plan of `config.parallel` on `cluster` (the layout must pass preflight's check)."""
    from megatron_rl.model.builder import model_vocab_rows

    p = config.parallel
    world = cluster.gpus
    dp, expert_dp = world // (p.tp * p.pp * p.cp), world // (p.expert_tp * p.ep * p.pp)
    probe = probe_parameters(arch, config, p.tp, p.ep, p.expert_tp)
    full = probe_parameters(arch, config, 1, 1, 1)  # unsharded: what a stage pushes
    kinds = layer_kinds(arch)
    x = act.ActivationInputs(
        tokens=config.micro_batch_tokens // p.cp, tp=p.tp, ep=p.ep, etp=p.expert_tp,
        sequence_parallel=p.uses_sequence_parallel, itemsize=_itemsize(config), recompute=config.model.recompute,
        logprob_chunk_tokens=config.logprob_chunk_tokens, vocab_rows=model_vocab_rows(arch, config.model, p.tp))
    push = _PushBytes.of(full, config, p.pp)
    stages, start = [], 0
    for stage, count in enumerate(stage_layer_counts(arch.num_layers, p)):
        first, last = stage == 0, stage == p.pp - 1
        stage_kinds = kinds[start:start + count]
        start += count
        params = probe.stage(stage_kinds, first=first, last=last, pp=p.pp)
        state = stage_states(params, dp=dp * p.cp, expert_dp=expert_dp,
                             distributed_optimizer=p.distributed_optimizer).worst()
        in_flight = p.pp - stage  # 1F1B: the first stage holds pp micro-batches before its first backward
        activations = in_flight * act.stage_bytes(arch, stage_kinds, x, first=first, last=last)
        stages.append(StagePlan(stage, count, state, activations, in_flight,
                                push.stage(stage_kinds, first=first, last=last)))
    engine_gpu = cluster.gpu_memory if cluster.colocated else (cluster.rollout_gpu_memory or cluster.gpu_memory)
    engine_budget = int(config.rollout.gpu_memory_utilization * engine_gpu)
    total_export = _PushBytes.of(full, config, 1).stage(kinds, first=True, last=True)
    engine_itemsize = 4 if config.rollout.dtype == "float32" else 2
    if not cluster.colocated:
        engine_tp = _server_tp(config)
        engine_weights = total_export // engine_tp
        trainer_budget = cluster.gpu_memory
        link = cluster.ib_gbs_per_node / cluster.gpus_per_node  # the stage leader's NIC
    else:
        engine_tp = world
        engine_weights = total_export // world
        trainer_budget = cluster.gpu_memory - engine_budget
        link = cluster.nvlink_gbs
    kv_cache = engine_budget - engine_weights
    kv_tokens = max(0, kv_cache) // kv_bytes_per_token(arch, engine_itemsize, engine_tp)
    push_seconds = max(s.push_bytes for s in stages) / (link * 1e9)
    return LayoutPlan(p, dp, expert_dp, tuple(stages), engine_weights, kv_cache, kv_tokens, engine_budget,
                      trainer_budget, push_seconds, cluster.gpu_memory)


def _server_tp(config) -> int:
    sizes = config.rollout.server_tp if isinstance(config.rollout.server_tp, list) else [config.rollout.server_tp]
    return max(sizes)


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def _divisors(n: int) -> list[int]:
    """The divisors of n, ascending, in O(sqrt(n)) steps (the GPUs' count, the experts')."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def candidate_layouts(config, arch, cluster: Cluster) -> list:
    """Every (tp, pp, ep, etp) preflight accepts on `cluster.gpus` trainer GPUs, with config's cp,
    sequence parallelism and optimizer: tp a power of two up to a node, etp 1 or tp, ep a divisor
    of the experts, pp a divisor of the GPUs; layers that do not split evenly over pp stages give
    the last stage the remainder (the others ceil(layers / pp)), as the DeepSeek-V3 recipe does."""
    from megatron_rl.model.layout_checks import check_layout

    base = config.parallel
    experts = arch.num_experts if arch.is_moe else 1
    layouts = []
    for tp in _powers_of_two(min(cluster.gpus_per_node, cluster.gpus)):
        for pp in _divisors(cluster.gpus // tp):
            if pp > arch.num_layers:
                continue
            stages = _even_or_last_remainder(arch.num_layers, pp)
            if stages is False:
                continue
            for etp in sorted({1, tp}) if arch.is_moe else [tp]:
                for ep in _divisors(experts):
                    parallel = dataclasses.replace(base, tp=tp, pp=pp, ep=ep, etp=etp if arch.is_moe else None,
                                                   pp_first_stage_layers=None, pp_last_stage_layers=stages)
                    candidate = dataclasses.replace(config, parallel=parallel)
                    try:
                        parallel.validate("parallel")
                        check_layout(candidate, arch, cluster.gpus)
                    except ConfigError:
                        continue
                    layouts.append(candidate)
    return layouts


def _even_or_last_remainder(layers: int, pp: int) -> int | None | bool:
    """None: even stages; an int: the last stage's layers; False: no split (fewer layers than stages)."""
    if layers % pp == 0:
        return None
    per = -(-layers // pp)
    last = layers - per * (pp - 1)
    return last if last >= 1 else False


@dataclasses.dataclass
class Plan:
    cluster: Cluster
    layouts: list  # LayoutPlan, ranked
    considered: int
    measured: object = None  # step_time.Selection (plan --measured)

    @property
    def ranking(self) -> tuple:
        return RANKING if self.measured is None else MEASURED_RANKING

    @property
    def fitting(self) -> list:
        return [layout for layout in self.layouts if layout.fits]


def plan_layouts(config, arch, cluster: Cluster, measured=None) -> Plan:
    """`measured`: a step_time.Selection, whose measurements time the layouts of their shape."""
    from megatron_rl.plan import step_time

    cluster.validate()
    plans = []
    for candidate in candidate_layouts(config, arch, cluster):
        layout = evaluate(candidate, arch, cluster)
        if measured is not None:
            layout = dataclasses.replace(layout, step=step_time.estimate(layout, config, arch, measured))
        plans.append(layout)
    return rank(Plan(cluster, plans, len(plans), measured))


def rank(plan: Plan) -> Plan:
    """The heuristic's order, then the measured layouts that fit reordered by their step time among
    the places they hold, tier by tier (a stable sort: equal times keep the heuristic's order)."""
    layouts = plan.layouts
    layouts.sort(key=lambda layout: layout.sort_key(plan.cluster))
    for low in (False, True):
        places = [i for i, layout in enumerate(layouts)
                  if layout.fits and layout.step is not None and layout.low_headroom == low]
        by_time = sorted((layouts[i] for i in places), key=lambda layout: layout.step.seconds)
        for i, layout in zip(places, by_time):
            layouts[i] = layout
    return plan


def smallest_fix(config, arch, cluster: Cluster, layout: LayoutPlan) -> str | None:
    """The first single change, from the least disruptive, that makes `config`'s layout fit."""
    p = config.parallel
    changes = []
    if config.model.recompute == "none":
        changes.append(("model.recompute=full", dataclasses.replace(config, model=dataclasses.replace(
            config.model, recompute="full"))))
    if not p.distributed_optimizer:
        changes.append(("parallel.distributed_optimizer=true", dataclasses.replace(
            config, parallel=dataclasses.replace(p, distributed_optimizer=True))))
    if arch.is_moe:
        changes.append((f"parallel.ep={p.ep * 2}",
                        dataclasses.replace(config, parallel=dataclasses.replace(p, ep=p.ep * 2))))
    stages = _even_or_last_remainder(arch.num_layers, p.pp * 2)
    if stages is not False:
        changes.append((f"parallel.pp={p.pp * 2}" + (f" parallel.pp_last_stage_layers={stages}" if stages else ""),
                        dataclasses.replace(config, parallel=dataclasses.replace(
                            p, pp=p.pp * 2, pp_first_stage_layers=None, pp_last_stage_layers=stages))))
    if config.micro_batch_tokens > 1024:
        changes.append((f"micro_batch_tokens={config.micro_batch_tokens // 2}",
                        dataclasses.replace(config, micro_batch_tokens=config.micro_batch_tokens // 2)))
    from megatron_rl.model.layout_checks import check_layout

    for text, changed in changes:
        try:
            changed.parallel.validate("parallel")
            check_layout(changed, arch, cluster.gpus)
        except ConfigError:
            continue
        if evaluate(changed, arch, cluster).fits:
            return text
    return None
