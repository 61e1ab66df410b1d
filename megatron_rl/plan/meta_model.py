"""Per-rank parameter lists of the real Megatron model, built on the meta device (no memory).

The planner does not count parameters from a formula: it builds the model exactly as training
builds it (model/builder.py: the same TransformerConfig, layer spec, padded vocabulary, MLA,
shared experts, router) inside a process group of the planned world size that exists only in
this process (torch's "fake" backend: every collective is a no-op), under `torch.device("meta")`,
so DeepSeek-V3's 256-expert layers cost Python objects, not bytes.

Building a whole pipeline stage for every candidate layout would be slow (a DeepSeek-V3 stage:
~0.3 s, and a 256-GPU search has hundreds of layouts), so one *probe* model is built per
(tp, ep, etp): the embedding, one layer of each kind the model has (dense, MoE), the final norm
and the output layer, at pp 1. A stage's ordered parameter list is then the probe's pieces in the
order Megatron builds a stage: embedding (first stage), the stage's layers, the final norm and
output layer (last stage). What differs between a stage and the probe is only which pieces it
holds, not their shapes: parameter shapes depend on tp/ep/etp, never on the layer's position or
on pp (tests/plan/test_meta_model.py checks the composition against whole stages built on meta).

The layer spec is the local one (no Transformer Engine on these machines); Transformer Engine's
spec holds the same parameters (fused norm+linear keeps the norm weight, grouped-GEMM experts keep
one weight per expert), so per-rank counts are the same. The process group and Megatron's parallel
state are process-wide: `probe_parameters` sets them up and tears them down around each build, and
refuses to run where torch.distributed is already initialized (inside a training process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

from megatron_rl.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ParamEntry:
    """One parameter of a rank's model as Megatron's DDP sees it."""

    name: str
    numel: int
    itemsize: int  # bytes per element of the parameter's dtype
    expert: bool  # expert-parallel (its gradients reduce over the expert-data-parallel group)
    fp8_served: bool = False  # a GEMM weight: served in block FP8 with model.export_fp8 (bridge/fp8_export.py)
    shared_embedding: bool = False  # tied embedding/output across pipeline stages: its own bucket
    frozen: bool = False  # not trained (the base under model.lora): no gradient, no optimizer state


@dataclasses.dataclass(frozen=True)
class ProbeParameters:
    """The pieces of one (tp, ep, etp) probe: parameter lists in Megatron's build order."""

    embedding: tuple[ParamEntry, ...]
    layers: dict  # "dense" / "moe" -> tuple[ParamEntry, ...] of one layer of that kind
    final_norm: tuple[ParamEntry, ...]
    output: tuple[ParamEntry, ...]  # empty when the output layer is the tied embedding (pp 1)
    tied: bool

    def stage(self, layer_kinds: list[str], *, first: bool, last: bool, pp: int) -> list[ParamEntry]:
        """The ordered parameters of a stage holding `layer_kinds` (one per layer, in order)."""
        shared = self.tied and pp > 1  # Megatron flags both copies; each is reduced on its own
        params: list[ParamEntry] = []
        if first:
            params += [dataclasses.replace(p, shared_embedding=shared) for p in self.embedding]
        for kind in layer_kinds:
            params += self.layers[kind]
        if last:
            params += self.final_norm
            if self.tied and pp > 1:
                # The last stage builds its own output weight (the embedding's shape) and keeps it
                # in sync with the first stage's through the embedding group.
                params += [dataclasses.replace(self.embedding[0], name="output_layer.weight", shared_embedding=True)]
            else:
                params += self.output
        return params


def layer_kinds(arch) -> list[str]:
    """'dense' / 'moe' for every decoder layer, in order."""
    if not arch.is_moe:
        return ["dense"] * arch.num_layers
    return ["moe" if sparse else "dense" for sparse in arch.moe_layer_pattern]


@contextlib.contextmanager
def planned_parallel_state(world: int, parallel, rank: int = 0):
    """Megatron's parallel state for `rank` of a `world`-rank job with the `parallel` layout,
    over torch's fake process group (no peers, no communication). Torn down on exit."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_rl.runtime.distributed import megatron_parallel_sizes
    # The fake backend and its store come with torch (its own distributed tests and DTensor's
    # tooling use them); importing the module registers the "fake" backend.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConfigError("the planner builds models in a process group of its own; run it in a process "
                          "that has not initialized torch.distributed (megatron-rl plan)")
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        parallel_state.initialize_model_parallel(**megatron_parallel_sizes(parallel), create_gloo_process_groups=False)
        yield
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _entries(module, prefix_of) -> dict[str, list[ParamEntry]]:
    from megatron_rl.bridge.fp8_export import quantized_in_export

    pieces: dict[str, list[ParamEntry]] = {}
    for name, param in module.named_parameters():
        entry = ParamEntry(name, param.numel(), param.element_size(), expert=not getattr(param, "allreduce", True),
                           fp8_served=quantized_in_export(name), frozen=not param.requires_grad)
        pieces.setdefault(prefix_of(name), []).append(entry)
    return pieces


def build_on_meta(arch, config, world: int, stage: int = 0):
    """The model of the first rank of pipeline stage `stage` on the meta device (`config.parallel`,
    `world` ranks; Megatron orders ranks tp-cp-ep-dp-pp, so stage s starts at rank s * world / pp)."""
    import torch

    from megatron_rl.model import builder
    from megatron_rl.runtime.cpu import megatron_patches

    # The CPU compatibility layer lets the local spec take sequence parallelism (MoE with tp > 1
    # requires it); it changes no parameter.
    megatron_patches.activate()
    if arch.is_moe:
        builder._define_router_gemm_without_te()
    with planned_parallel_state(world, config.parallel, rank=stage * world // config.parallel.pp):
        tconfig = builder.transformer_config(arch, config, torch.device("cpu"), use_te=False)
        tconfig.perform_initialization = False
        with torch.device("meta"):
            return builder.build_gpt_model(arch, tconfig, config.model, use_te=False)


@functools.lru_cache(maxsize=256)
def _probe_cached(arch, config_key, tp: int, ep: int, etp: int) -> ProbeParameters:
    config = _probe_config(config_key, tp, ep, etp)
    kinds = layer_kinds(arch)
    probe_kinds = [kind for kind in ("dense", "moe") if kind in kinds]
    pattern = tuple(kind == "moe" for kind in probe_kinds)
    # YaRN's cos/sin cache (a buffer, no parameter) is computed on the CPU at build time for
    # original_max_position_embeddings positions: 40% of a DeepSeek-V3 probe's build for nothing the
    # planner reads, so the probe's holds two.
    yarn = dataclasses.replace(arch.yarn, original_max_position_embeddings=2) if arch.yarn is not None else None
    probe_arch = dataclasses.replace(arch, num_layers=len(probe_kinds), yarn=yarn,
                                     moe_layer_pattern=pattern if arch.is_moe else arch.moe_layer_pattern)
    world = math.lcm(tp, ep * etp)
    module = build_on_meta(probe_arch, config, world)

    def piece(name: str) -> str:
        if name.startswith("embedding."):
            return "embedding"
        if name.startswith("decoder.layers."):
            return probe_kinds[int(name.split(".")[2])]
        if name.startswith("decoder.final_layernorm."):
            return "final_norm"
        if name.startswith("output_layer."):
            return "output"
        raise ConfigError(f"planner: a parameter it cannot place in a stage: {name}")

    pieces = _entries(module, piece)
    return ProbeParameters(
        embedding=tuple(pieces.get("embedding", ())),
        layers={kind: tuple(pieces.get(kind, ())) for kind in probe_kinds},
        final_norm=tuple(pieces.get("final_norm", ())),
        output=tuple(pieces.get("output", ())),
        tied=arch.tie_word_embeddings,
    )


def _probe_config(config_key, tp: int, ep: int, etp: int):
    config = config_key.config
    parallel = dataclasses.replace(config.parallel, tp=tp, pp=1, ep=ep, etp=etp, cp=1,
                                   pp_first_stage_layers=None, pp_last_stage_layers=None,
                                   sequence_parallel=None)
    return dataclasses.replace(config, parallel=parallel)


class _ConfigKey:
    """A RunConfig made hashable by the fields that shape parameters (for the probe cache)."""

    def __init__(self, config):
        self.config = config
        model = config.model
        lora = model.lora
        self.key = (model.precision, model.make_vocab_size_divisible_by, model.padded_vocab_size,
                    model.moe_token_dispatcher, model.moe_aux_loss_coeff,
                    None if lora is None else (lora.rank, tuple(lora.targets or ())))

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, _ConfigKey) and self.key == other.key


def probe_parameters(arch, config, tp: int, ep: int, etp: int) -> ProbeParameters:
    """The parameter pieces of `arch` at (tp, ep, etp), from the real Megatron model on meta."""
    return _probe_cached(arch, _ConfigKey(_without_fp8(config)), tp, ep, etp)


def _without_fp8(config):
    """FP8 recipes change no parameter shape or count (weights stay in params_dtype unless
    model.fp8_param, accounted for by the planner); the probe is built without them so that the
    planning machine's missing FP8 hardware does not matter. The throughput levers (LEVERS_OFF)
    change no parameter either and need Transformer Engine: off in the probe too."""
    from megatron_rl.config.model import LEVERS_OFF

    model = dataclasses.replace(config.model, fp8_recipe=None, fp8_param=False, fp8_bf16_first_layers=0,
                                fp8_bf16_last_layers=0, export_fp8=False, layer_spec="local",
                                moe_grouped_gemm=None, **LEVERS_OFF)
    return dataclasses.replace(config, model=model, device="cpu")


def stage_layer_counts(num_layers: int, parallel) -> list[int]:
    """Layers per pipeline stage, as Megatron splits them (first/last stage sizes when given)."""
    pp, first, last = parallel.pp, parallel.pp_first_stage_layers, parallel.pp_last_stage_layers
    middle_stages = pp - (first is not None) - (last is not None)
    middle = (num_layers - (first or 0) - (last or 0)) // middle_stages if middle_stages else 0
    counts = [middle] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts
