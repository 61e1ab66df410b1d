"""The `megatron-rl plan` command: resolve the model, plan, print."""

from __future__ import annotations

import dataclasses
import json
import re
import sys

from megatron_rl.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(GiB|GB|G)?\s*$", re.IGNORECASE)


def parse_memory(text: str, flag: str = "--gpu-memory") -> int:
    """'80GiB' / '80GB' / '80' (GiB) -> bytes."""
    match = _SIZE.match(text)
    if not match:
        raise ConfigError(f"{flag} {text!r}: give a size such as 80GiB, 141GiB or 80GB")
    value, unit = float(match.group(1)), (match.group(2) or "GiB").lower()
    return int(value * (1e9 if unit == "gb" else 1024**3))


def resolve_architecture(config, hf_config: str | None):
    """The model to plan: --hf-config, else model.hf_config when it loads here, else
    model.architecture (a preset or config.json standing in for a download not at hand). Both
    recipe sources loading must agree."""
    from megatron_rl.model.hf_config import load_hf_config, parse_hf_config

    if hf_config:
        raw, source = load_hf_config(hf_config)
        return parse_hf_config(raw, source), source
    try:
        raw, source = load_hf_config(config.model.hf_config)
    except ConfigError:
        if not config.model.architecture:
            raise ConfigError(
                f"model.hf_config: {config.model.hf_config} is not here to read the model from; pass --hf-config "
                "DIR (a directory with config.json, or a preset), or set model.architecture in the recipe") from None
        raw, source = load_hf_config(config.model.architecture)
        return parse_hf_config(raw, source), source
    arch = parse_hf_config(raw, source)
    if config.model.architecture:
        declared_raw, declared_source = load_hf_config(config.model.architecture)
        declared = parse_hf_config(declared_raw, declared_source)
        # the same model downloaded in FP8 or BF16 differs only in its weights' format
        if dataclasses.replace(declared, fp8_block=arch.fp8_block) != arch:
            raise ConfigError(f"model.architecture ({declared_source}) and model.hf_config ({source}) describe "
                              "different models; fix the recipe so both name the same one")
    return arch, source


def run(args, config) -> int:
    from megatron_rl.plan import report
    from megatron_rl.plan.planner import Cluster, evaluate, plan_layouts, smallest_fix
    from megatron_rl.plan import step_time
    from megatron_rl.plan.measured import load_table
    from megatron_rl.model.layout_checks import check_layout

    if args.top < 1:
        raise ConfigError(f"--top must be at least 1 (layouts shown in the table), got {args.top}")
    if config.device == "cpu":
        raise ConfigError("the planner plans GPU clusters: the config says device: cpu; use device=cuda (or auto)")
    if args.rollout_gpus and config.rollout.mode == "colocated":
        config = _with_rollout_mode(config, "server")  # --rollout-gpus: servers on GPUs of their own
    rollout_memory = parse_memory(args.rollout_gpu_memory, "--rollout-gpu-memory") if args.rollout_gpu_memory else None
    # The flags first (milliseconds), then the model
    cluster = Cluster(gpus=args.gpus, gpus_per_node=args.gpus_per_node, gpu_memory=parse_memory(args.gpu_memory),
                      rollout_gpu_memory=rollout_memory, rollout_gpus=args.rollout_gpus,
                      colocated=config.rollout.mode == "colocated",
                      nvlink_gbs=args.nvlink_gbs, ib_gbs_per_node=args.ib_gbs_per_node).validate()
    if (args.gpu_name is not None or args.step_tokens is not None) and not args.measured:
        raise ConfigError("--gpu-name and --step-tokens choose what of a --measured table is used: give --measured FILE")
    table = load_table(args.measured) if args.measured else None  # every line checked before the model is read
    arch, source = resolve_architecture(config, args.hf_config)
    measured = step_time.select(table, config, arch, args.gpu_name, args.step_tokens) if table else None
    plan = plan_layouts(config, arch, cluster, measured)
    own = fix = None
    try:
        check_layout(config, arch, cluster.gpus)
    except ConfigError as exc:
        print(f"megatron-rl plan: the config's own layout is not accepted on {cluster.gpus} GPUs: {exc}",
              file=sys.stderr)
    else:
        own = evaluate(config, arch, cluster)
        if measured is not None:
            own = dataclasses.replace(own, step=step_time.estimate(own, config, arch, measured))
        fix = None if own.fits else smallest_fix(config, arch, cluster, own)
    if args.json:
        print(json.dumps(report.as_json(config, arch, plan, own, fix), indent=1))
    elif args.recipe_header:
        print(report.recipe_header(config, plan, own, args.recipe_header, top=args.top))
    else:
        print(report.describe(config, arch, plan, source=source, top=args.top, own=own, fix=fix))
    return 0 if plan.fitting else 3


def _with_rollout_mode(config, mode: str):
    return dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, mode=mode))
