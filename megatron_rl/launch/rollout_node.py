"""A rollout node of a disaggregated SLURM job: one vLLM OpenAI server, until the job stops it.

    python -m megatron_rl.launch.rollout_node --config run/config.yaml --port 8100 --name vllm-0

The server gets the model's config and tokenizer (written here, in OUTPUT_DIR/rollout/NAME/model)
and dummy weights: the trainer pushes its weights before the first rollout. Log:
OUTPUT_DIR/logs/NAME.log.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from megatron_rl.config import load_config


def write_engine_model(config, directory: Path) -> None:
    """What the trainer writes for its own engines: config.json, generation config, tokenizer."""
    from megatron_rl.data.tokenizer import write_run_tokenizer
    from megatron_rl.model.hf_config import load_hf_config

    directory.mkdir(parents=True, exist_ok=True)
    raw, _ = load_hf_config(config.model.hf_config)
    raw = dict(raw)
    (directory / "config.json").write_text(json.dumps(raw, indent=1))
    generation = {key: raw[key] for key in ("bos_token_id", "eos_token_id") if key in raw}
    (directory / "generation_config.json").write_text(json.dumps(generation))
    write_run_tokenizer(config, directory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_rl.launch.rollout_node")
    parser.add_argument("--config", required=True)
    parser.add_argument("--name", default="vllm-0")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args(argv)
    config = load_config(args.config)

    from megatron_rl.rollout.factory import engine_dtype
    from megatron_rl.rollout.vllm_server import VllmServerProcess

    out = Path(config.output_dir)
    model_dir = out / "rollout" / args.name / "model"
    write_engine_model(config, model_dir)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    rollout = config.rollout
    server = VllmServerProcess.start(
        model_dir, port=args.port, host=args.host, log_path=out / "logs" / f"{args.name}.log", name=args.name,
        dtype=engine_dtype(config), max_model_len=rollout.max_model_len, seed=config.seed,
        cpu_kv_cache_gib=rollout.cpu_kv_cache_gib,
        gpu_memory_utilization=rollout.gpu_memory_utilization, load_format="dummy",
        startup_timeout_s=rollout.startup_timeout_s,
        extra_args=["--tensor-parallel-size", str(args.tensor_parallel_size)],
    )
    print(f"[megatron-rl] {args.name} serving on port {args.port} (model {model_dir})", flush=True)
    try:
        while not stop.wait(2.0):
            if not server.alive():
                print(f"[megatron-rl] {args.name} exited; last lines of {server.log_path}:\n{server.log_tail()}",
                      file=sys.stderr)
                return 1
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
