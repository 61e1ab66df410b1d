"""`megatron-rl` command line.

    megatron-rl train [--config FILE] [--output-dir DIR] [key=value ...]   (the RL loop; no config: the tiny default)
    megatron-rl smoke [--config FILE] [--steps N] [key=value ...]
    megatron-rl inspect-model [--config FILE] [key=value ...]
    megatron-rl convert {hf-to-megatron,megatron-to-hf} ...   (see tools/convert_*.py)

Settings come from one YAML recipe plus `section.key=value` overrides (see megatron_rl/config.py).
Multi-rank runs: start the same command under torchrun (or srun); the layout comes from the
`parallel` section.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

from megatron_rl.config import ConfigError, load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-rl", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    def common(sub):
        sub.add_argument("--config", help="YAML recipe (default: the built-in tiny default)")
        sub.add_argument("overrides", nargs="*", help="section.key=value overrides")

    train = commands.add_parser("train", help="run the main job")
    common(train)
    train.add_argument("--output-dir", help="where everything of the run goes")
    smoke = commands.add_parser("smoke", help="forward/backward smoke run of the policy")
    common(smoke)
    smoke.add_argument("--output-dir")
    smoke.add_argument("--steps", type=int, default=5)
    inspect = commands.add_parser("inspect-model", help="print the architecture a config builds")
    common(inspect)
    commands.add_parser("convert", help="HF <-> Megatron checkpoint conversion (see tools/)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "convert":
        from megatron_rl import convert

        return convert.main(argv[1:])
    args = _parser().parse_args(argv)
    overrides = list(args.overrides)
    if getattr(args, "output_dir", None):
        overrides.append(f"output_dir={args.output_dir}")
    try:
        config = load_config(args.config, overrides)
        if args.command == "inspect-model":
            from megatron_rl.model.hf_config import load_hf_config, parse_hf_config

            print(json.dumps(parse_hf_config(*load_hf_config(config.model.hf_config)).__dict__, indent=2))
            return 0
        if args.command == "train":
            from megatron_rl.preflight import check_layout_and_paths

            check_layout_and_paths(config)  # milliseconds: before torch is even imported
        _quiet_known_upstream_warnings()
        if args.command == "train":
            from megatron_rl.trainer import train

            result = train(config)
            _print_summary(config, result)
            return 0
        from megatron_rl.smoke import run_smoke

        run_smoke(config, steps=args.steps)
        return 0
    except ConfigError as exc:
        print(f"megatron-rl: configuration error: {exc}", file=sys.stderr)
        return 2


def _print_summary(config, result) -> None:
    if not result.is_driver:
        return
    if not result.finished:
        print(f"stopped after step {result.steps_done} (checkpoint {result.checkpoint})")
        return
    print(f"done: {result.steps_done} RL steps, output in {config.output_dir}")
    if result.warm_start_accuracy is not None and result.final_accuracy is not None:
        print(f"held-out accuracy: {result.warm_start_accuracy:.3f} before RL (after the warm start) -> "
              f"{result.final_accuracy:.3f} after RL")
    if result.curve_png is not None:
        print(f"learning curve: {result.curve_png}")


def _quiet_known_upstream_warnings() -> None:
    # Expected on CPU, or marked as known in Megatron-Core's own source; they bury real output.
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*not installed.*")
    warnings.filterwarnings("ignore", message=".*The .grad attribute of a Tensor that is not a leaf.*")
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use .*_single.*", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")


if __name__ == "__main__":
    sys.exit(main())
