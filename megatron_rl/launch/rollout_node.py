"""A rollout node of a disaggregated SLURM job: vLLM OpenAI servers, until the job stops them.

    python -m megatron_rl.launch.rollout_node --config run/config.yaml --index 0 --port 8100 \
        [--servers 4 --tensor-parallel-size 2]

Starts `--servers` servers (default 1) numbered from `--index`, on consecutive ports from
`--port`, each over `--tensor-parallel-size` GPUs of this node (the node's GPUs split in order:
CUDA_VISIBLE_DEVICES, as SLURM sets it, or all of them); on CPU one server. Server INDEX is
named vllm-INDEX, seeded seed + INDEX, logs to OUTPUT_DIR/logs/vllm-INDEX.log and starts from
OUTPUT_DIR/rollout/vllm-INDEX/model: the model's config and tokenizer, written by the function the
trainer uses for its own engines (megatron_rl.rollout.engine_model), and dummy weights. The trainer
pushes its weights before the first rollout and after every step.

Nothing transport-specific is set at start-up: every server runs our worker extension
(megatron_rl.rollout.worker.extension) with VLLM_SERVER_DEV_MODE=1 (POST /collective_rpc), set by
VllmServerProcess.start. Through /collective_rpc the trainer asks the server's workers to load
safetensors files (rollout.weight_transport: files) or to join a process group with the trainer's
pipeline-stage leaders over a TCP rendezvous on MASTER_ADDR and receive their broadcasts
(collective: gloo on CPU, NCCL on GPU): this node must reach the first training node over TCP.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from megatron_rl.config import load_config

from megatron_rl.errors import ConfigError
from megatron_rl.rollout.auth import TOKEN_ENV, rollout_token


def start_server(config, *, index: int, port: int, host: str, tensor_parallel_size: int):
    """Write the engine's model directory and start server `index`; returns the
    VllmServerProcess once it answers /health."""
    from megatron_rl.rollout.engine_model import write_engine_model_dir
    from megatron_rl.rollout.factory import engine_dtype, server_args
    from megatron_rl.rollout.engines.vllm_server import VllmServerProcess

    if config.rollout.engine != "vllm":
        raise ConfigError(f"rollout.engine={config.rollout.engine}: rollout nodes run vLLM servers only")
    if tensor_parallel_size < 1:
        raise ConfigError(f"--tensor-parallel-size must be >= 1, got {tensor_parallel_size}")
    name = f"vllm-{index}"
    out = Path(config.output_dir)
    model_dir = write_engine_model_dir(config, out / "rollout" / name / "model")
    rollout = config.rollout
    return VllmServerProcess.start(
        model_dir, port=port, host=host, log_path=out / "logs" / f"{name}.log", name=name,
        dtype=engine_dtype(config), max_model_len=rollout.max_model_len, seed=config.seed + index,
        cpu_kv_cache_gib=rollout.cpu_kv_cache_gib,
        gpu_memory_utilization=rollout.gpu_memory_utilization, load_format="dummy",
        startup_timeout_s=rollout.startup_timeout_s,
        extra_args=server_args(config, tensor_parallel_size),
    )


def device_groups(servers: int, tensor_parallel_size: int, environ=os.environ) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each of `servers` servers: this node's GPUs split in order."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        devices = [device for device in visible.split(",") if device.strip()]
    else:
        import torch

        devices = [str(index) for index in range(torch.cuda.device_count())]
    needed = servers * tensor_parallel_size
    if len(devices) < needed:
        raise ConfigError(f"{servers} server(s) of tensor parallel {tensor_parallel_size} need {needed} GPUs; "
                          f"this node has {len(devices)} ({', '.join(devices) or 'none'})")
    return [",".join(devices[k * tensor_parallel_size:(k + 1) * tensor_parallel_size]) for k in range(servers)]


def serve_one(args) -> int:
    def abort(signum, frame):  # while starting: stops the half-started server (ServerProcess.launch)
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, abort)
    try:
        config = load_config(args.config)
        server = start_server(config, index=args.index, port=args.port, host=args.host,
                              tensor_parallel_size=args.tensor_parallel_size)
    except ConfigError as exc:
        print(f"megatron-rl: configuration error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    print(f"[megatron-rl] {server.name} ({os.uname().nodename}{', GPUs ' + gpus if gpus else ''}) serving on port "
          f"{args.port}, tensor parallel {args.tensor_parallel_size}; weights come from the trainer "
          f"(rendezvous host {os.environ.get('MASTER_ADDR', 'unset')})", flush=True)
    try:
        while not stop.wait(2.0):
            if not server.alive():
                print(f"[megatron-rl] {server.name} exited; last lines of {server.log_path}:\n{server.log_tail()}",
                      file=sys.stderr)
                return 1
        return 0
    finally:
        server.stop()


def serve_many(args) -> int:
    """One child process per server (each with its own GPUs); stops them all when one fails or
    this process is asked to stop."""
    try:
        groups = device_groups(args.servers, args.tensor_parallel_size)
    except ConfigError as exc:
        print(f"megatron-rl: configuration error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    children = []
    for k, devices in enumerate(groups):
        command = [sys.executable, "-m", "megatron_rl.launch.rollout_node", "--config", args.config,
                   "--index", str(args.index + k), "--port", str(args.port + k), "--host", args.host,
                   "--tensor-parallel-size", str(args.tensor_parallel_size)]
        children.append(subprocess.Popen(command, env=dict(os.environ, CUDA_VISIBLE_DEVICES=devices)))
    code = 0
    try:
        while not stop.wait(2.0):
            failed = [child for child in children if child.poll() is not None]
            if failed:
                code = failed[0].returncode or 1
                break
    finally:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            child.wait()
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_rl.launch.rollout_node")
    parser.add_argument("--config", required=True)
    parser.add_argument("--index", type=int, default=0, help="number of the (first) server: vllm-INDEX, seed + INDEX")
    parser.add_argument("--port", type=int, required=True, help="port of the (first) server")
    parser.add_argument("--host", default=None,
                        help="address to listen on (default: this node's own address, the one its host name "
                             "resolves to; 0.0.0.0 listens on every interface, only if you mean it)")
    parser.add_argument("--servers", type=int, default=1, help="servers on this node (GPU), each on its own GPUs")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args(argv)
    if args.servers < 1:
        parser.error("--servers must be >= 1")
    if rollout_token() is None:
        # Refused here rather than by the server: its log would be the only trace.
        parser.error(f"{TOKEN_ENV} is not set: every request to a rollout server must carry the job's token "
                     f"(the SLURM job script exports one per job; elsewhere export the same value to the servers "
                     f"and the trainer, e.g. from `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    if args.host is None:
        args.host = socket.gethostbyname(socket.gethostname())
    return serve_one(args) if args.servers == 1 else serve_many(args)


if __name__ == "__main__":
    sys.exit(main())
