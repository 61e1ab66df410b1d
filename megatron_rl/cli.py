"""`megatron-rl` command line.

    megatron-rl train [--config FILE] [--output-dir DIR] [key=value ...]   (the RL loop; no config: the tiny default)
    megatron-rl sft [--config FILE] [--output-dir DIR] [--force] [key=value ...]   (the supervised warm start
        alone: writes a checkpoint, default OUTPUT_DIR/sft, for `train checkpoint.init_from=DIR warm_start.steps=0`)
    megatron-rl smoke [--config FILE] [--steps N] [--output-dir DIR] [key=value ...]   (metrics: runs/smoke by default)
    megatron-rl inspect-model [--config FILE] [key=value ...]
    megatron-rl convert {hf-to-megatron,megatron-to-hf,megatron-to-peft,peft-to-megatron} ...   (tools/convert*.py)
    megatron-rl verify-hf --hf-dir DIR [--tp N] [--pp N] [--ep N] [--etp N] [--tolerance T] [--tokens N]
        [--seed S]   (Megatron's logits against transformers' for a HF model, at that layout)
    megatron-rl launch slurm --nodes N [--gpus-per-node G] [--partition P] ... [--dry-run] [key=value ...]
    megatron-rl launch local [--nproc-per-node N] [key=value ...]   (the same job under torchrun here)
    megatron-rl eval --ckpt PATH [--ckpt PATH ...] --set NAME=PATH [--set ...] [--n N] [--k K,...]
        [--temperature T] [--top-p P] [--out DIR] [key=value ...] [set.NAME.OPTION=VALUE ...]
        (pass@k, avg@n, maj@k, greedy accuracy of checkpoints; several: their differences)
    megatron-rl plan --gpus N [--config FILE] [--hf-config DIR] [--gpus-per-node G] [--gpu-memory 80GiB]
        [--rollout-gpus M] [--json] [key=value ...]   (every layout that fits, per-GPU memory, weight push)

Settings come from one YAML recipe plus `section.key=value` overrides (see megatron_rl/config.py).
Multi-rank runs: start the same command under torchrun (or srun); the layout comes from the
`parallel` section.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import gc
import json
import sys

from megatron_rl.config import load_config

from megatron_rl.errors import ConfigError, TrainingStopped

# A smoke run appends to OUTPUT_DIR/metrics.jsonl: by default it must not write into the directory
# of the main job the same recipe names (its rows would mix with the real run's curve).
SMOKE_OUTPUT_DIR = "runs/smoke"

# A finished command's interpreter spent 2.5 s of its 4.4 s exit (`megatron-rl sft`, 2 cores) in its
# last garbage collections, over the heap torch, Megatron-Core, transformers and vLLM fill: what
# is alive then ends with the process, so it leaves the collector's view first. Registered at
# import, this runs after the exit handlers registered later (wandb's, multiprocessing's); runs
# forked by the tests' pre-imported server end without any of it already (os._exit).
atexit.register(gc.freeze)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-rl", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    def common(sub):
        sub.add_argument("--config", help="YAML recipe (default: the built-in tiny default)")
        sub.add_argument("overrides", nargs="*", help="section.key=value overrides")
        sub.add_argument("--verbose", action="store_true",
                         help="show dependencies' warnings and log lines (hidden by default)")

    train = commands.add_parser("train", help="run the main job")
    common(train)
    train.add_argument("--output-dir", help="where everything of the run goes")
    sft = commands.add_parser("sft", help="supervised warm start alone: writes a checkpoint train starts from")
    common(sft)
    sft.add_argument("--output-dir", help="the checkpoint directory (default: OUTPUT_DIR/sft)")
    sft.add_argument("--force", action="store_true", help="replace an existing output directory")
    smoke = commands.add_parser("smoke", help="forward/backward smoke run of the policy")
    common(smoke)
    smoke.add_argument("--output-dir", help=f"where its metrics.jsonl goes (default: {SMOKE_OUTPUT_DIR}, "
                       "never the main job's directory from the recipe)")
    smoke.add_argument("--steps", type=int, default=5)
    inspect = commands.add_parser("inspect-model", help="print the architecture a config builds")
    common(inspect)
    commands.add_parser("convert", help="HF <-> Megatron checkpoint conversion (see tools/)", add_help=False)
    commands.add_parser("verify-hf", help="check that Megatron computes transformers' logits for a HF model "
                        "directory (megatron-rl verify-hf --help)", add_help=False)
    plan = commands.add_parser("plan", help="the parallel layouts that fit a cluster, memory per GPU, weight push")
    common(plan)
    plan.add_argument("--gpus", type=int, required=True, help="trainer GPUs")
    plan.add_argument("--gpus-per-node", type=int, default=8)
    plan.add_argument("--gpu-memory", default="80GiB", help="memory per GPU, e.g. 80GiB (H100), 141GB (H200)")
    plan.add_argument("--rollout-gpus", type=int, default=0,
                      help="GPUs of the rollout servers (rollout.server_tp each); 0: engines colocated")
    plan.add_argument("--rollout-gpu-memory", help="memory per rollout-server GPU (default: --gpu-memory)")
    plan.add_argument("--hf-config", help="the model (a config.json directory or a preset) instead of the recipe's")
    plan.add_argument("--nvlink-gbs", type=float, default=450.0, help="NVLink GB/s per GPU, one way")
    plan.add_argument("--ib-gbs-per-node", type=float, default=400.0, help="InfiniBand GB/s per node")
    plan.add_argument("--top", type=int, default=15, help="layouts shown in the table")
    plan.add_argument("--json", action="store_true", help="every layout as JSON")
    plan.add_argument("--recipe-header", metavar="COMMAND",
                      help="print the plan as a recipe's header comment, naming COMMAND (this command line)")
    plan.add_argument("--measured", metavar="FILE", help="measured per-GPU step times (a sweep's step_times.jsonl): "
                      "layouts of a measured shape rank by their estimated step time (docs/planning.md)")
    plan.add_argument("--gpu-name", help="the GPU planned, as the --measured table names it (e.g. 'NVIDIA H200')")
    plan.add_argument("--step-tokens", type=int, help="tokens one RL step trains, for --measured (default: "
                      "prompts_per_step x group_size x max_model_len)")
    from megatron_rl.evaluation.command import add_parser as add_eval_parser

    add_eval_parser(commands)
    launch = commands.add_parser("launch", help="start the training job on SLURM or with torchrun here")
    where = launch.add_subparsers(dest="where", required=True)
    slurm = where.add_parser("slurm", help="render an sbatch script from slurm/ and submit it")
    common(slurm)
    slurm.add_argument("--output-dir", help="run directory (config copy, logs, checkpoints)")
    slurm.add_argument("--nodes", type=int, required=True, help="training nodes")
    slurm.add_argument("--rollout-nodes", type=int, default=0,
                       help="extra nodes running vLLM servers of rollout.server_tp GPUs each (disaggregated); 0: colocated")
    slurm.add_argument("--gpus-per-node", type=int, default=0, help="0: CPU (gloo)")
    slurm.add_argument("--procs-per-node", type=int, help="trainer processes per node (default: GPUs, or 1)")
    slurm.add_argument("--partition")
    slurm.add_argument("--account")
    slurm.add_argument("--time", help="time limit, e.g. 04:00:00")
    slurm.add_argument("--job-name", default="megatron-rl")
    slurm.add_argument("--signal-lead-seconds", type=int, default=120,
                       help="USR1 this long before the time limit: checkpoint and requeue")
    slurm.add_argument("--container-image", help="srun --container-image (pyxis/enroot)")
    slurm.add_argument("--container-mounts", help="srun --container-mounts")
    slurm.add_argument("--module", dest="modules", action="append", default=[], help="`module load` this (repeatable)")
    slurm.add_argument("--setup", action="append", default=[], help="a shell line run first in the job (repeatable)")
    slurm.add_argument("--network-interface", help="sets NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME")
    slurm.add_argument("--python", help="interpreter in the job (default: the one running this command)")
    slurm.add_argument("--sbatch-arg", dest="sbatch_args", action="append", default=[],
                       help="extra #SBATCH option, e.g. --sbatch-arg=--exclusive (repeatable)")
    slurm.add_argument("--server-timeout-s", type=int, default=900,
                       help="disaggregated: seconds each rollout server may take to become healthy")
    slurm.add_argument("--template", help="your own sbatch template (a copy of one in slurm/)")
    slurm.add_argument("--dry-run", action="store_true", help="print the script, submit nothing, write nothing")
    local = where.add_parser("local", help="run the job on this machine with torchrun")
    common(local)
    local.add_argument("--output-dir")
    local.add_argument("--nproc-per-node", type=int, default=1)
    local.add_argument("--dry-run", action="store_true", help="print the torchrun command only")
    return parser


def _engine_kernels_line(config) -> str:
    """--verbose: the CPU features detected and the kernels a CPU rollout engine will get."""
    from megatron_rl.model.hf_config import load_hf_config
    from megatron_rl.rollout.factory import engine_dtype
    from megatron_rl.runtime.cpu.vllm_kernels import cpu_features, describe
    from megatron_rl.train.preflight import engines_on_cpu

    if not engines_on_cpu(config):
        return f"megatron-rl: {describe(cpu_features())}; rollout engines are not vLLM's CPU build"
    raw, _ = load_hf_config(config.model.hf_config)
    return f"megatron-rl: {describe(cpu_features(), raw, engine_dtype(config))}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "convert":
        from megatron_rl.tools import convert

        return convert.main(argv[1:])
    if argv and argv[0] == "verify-hf":
        from megatron_rl.tools import verify_hf

        return verify_hf.main(argv[1:])
    args = parse_command_line(argv)
    if not getattr(args, "verbose", False):
        from megatron_rl.observability.console import quiet_dependencies

        quiet_dependencies()  # before anything imports torch
    overrides = command_overrides(args)
    try:
        if args.command == "launch":
            return _launch(args, overrides)
        if args.command == "eval":  # its overrides hold per-set options too: it loads its configs itself
            from megatron_rl.evaluation.command import run as run_eval

            return run_eval(args)
        config = load_config(args.config, overrides)
        if args.command == "plan":
            from megatron_rl.plan.command import run as plan

            return plan(args, config)
        if args.command == "inspect-model":
            from megatron_rl.model.hf_config import load_hf_config, parse_hf_config

            print(json.dumps(parse_hf_config(*load_hf_config(config.model.hf_config)).__dict__, indent=2))
            return 0
        if args.command == "train":
            from megatron_rl.train.preflight import check_layout_and_paths

            check_layout_and_paths(config)  # milliseconds: before torch is even imported
            if args.verbose:
                print(_engine_kernels_line(config), flush=True)
        if args.command == "sft":
            return _sft(args, config, overrides)
        if args.command == "train":
            from megatron_rl.train.trainer import train

            result = train(config)
            _print_summary(config, result)
            return 0
        from megatron_rl.train.smoke import run_smoke

        run_smoke(config, steps=args.steps)
        return 0
    except ConfigError as exc:
        print(f"megatron-rl: configuration error: {exc}", file=sys.stderr)
        return 2
    except TrainingStopped as exc:
        print(f"megatron-rl: training stopped: {exc}", file=sys.stderr)
        return 1


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """argparse takes one run of positionals: in `train rl.steps=3 --output-dir D rl.recipe=gspo`
    the overrides after the option came back as "unrecognized arguments". They are overrides all
    the same, kept in command-line order (a later value of a key wins); anything else left over is
    still refused."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and (not hasattr(args, "overrides") or any(item.startswith("-") or "=" not in item for item in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def command_overrides(args) -> list[str]:
    """The `key=value` overrides of a parsed command line, with --output-dir folded in (output_dir
    is typed as text, so the loader keeps the path as written: config/loader.py)."""
    overrides = list(args.overrides)
    if getattr(args, "output_dir", None) and args.command != "sft":  # sft: the checkpoint itself
        overrides.append(f"output_dir={args.output_dir}")
    elif args.command == "smoke" and not any(item.split("=", 1)[0].strip() == "output_dir" for item in overrides):
        overrides.append(f"output_dir={SMOKE_OUTPUT_DIR}")
    return overrides


def _sft(args, config, overrides: list[str]) -> int:
    from megatron_rl.train import sft

    result = sft.run_sft(config, args.output_dir, force=args.force)  # checks everything before importing torch
    if result.is_driver:
        print(f"done: {len(result.losses)} sft steps, loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}; "
              f"checkpoint in {result.output}")
        train, convert = sft.next_commands(result, args.config, overrides)
        print(f"next: {train}")
        print(f"      (a Hugging Face model: {convert})")
    return 0


def _launch(args, overrides: list[str]) -> int:
    from megatron_rl.launch.slurm import LaunchError

    if args.where == "local":
        from megatron_rl.launch.local import run_local

        return run_local(args.config, overrides, args.nproc_per_node, dry_run=args.dry_run)
    from megatron_rl.launch import slurm

    options = slurm.SlurmOptions(**{field.name: getattr(args, field.name)
                                    for field in dataclasses.fields(slurm.SlurmOptions)})
    job = slurm.prepare(args.config, overrides, options, write=not args.dry_run)
    if args.dry_run:
        print(job.script, end="")
        return 0
    try:
        job_id = slurm.submit(job)
    except LaunchError as exc:
        print(f"megatron-rl: {exc}", file=sys.stderr)
        return 1
    print(f"submitted job {job_id}: {options.nodes + options.rollout_nodes} node(s), "
          f"{options.world_size} trainer process(es)")
    print(f"  script: {job.script_path}")
    print(f"  config: {job.config_path}")
    print(f"  log:    {slurm.log_path(job, job_id)}")
    print(f"  run:    {job.output_dir} (metrics.jsonl, checkpoints/)")
    return 0


def _print_summary(config, result) -> None:
    if not result.is_driver:
        return
    if not result.finished:
        if result.checkpoint is None:  # a signal in the warm start: nothing saved (the trainer's line says why)
            print("stopped in the warm start, before any checkpoint; the same command starts the run again")
        else:
            print(f"stopped after step {result.steps_done} (checkpoint {result.checkpoint})")
        return
    print(f"done: {result.steps_done} RL steps, output in {config.output_dir}")
    if result.warm_start_accuracy is not None and result.final_accuracy is not None:
        before = "after the warm start" if config.warm_start.steps else "the initial policy"
        print(f"held-out accuracy: {result.warm_start_accuracy:.3f} before RL ({before}) -> "
              f"{result.final_accuracy:.3f} after RL")
    if result.curve_png is not None:
        print(f"learning curve: {result.curve_png}")


if __name__ == "__main__":
    sys.exit(main())
