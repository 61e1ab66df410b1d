"""Benchmark: bridge export (Megatron -> HF tensors) and import (HF safetensors -> Megatron).

A Qwen3-MoE-shaped model of about 2 GB of fp32 parameters (default: 8 layers, hidden 1024,
16 experts of width 1024, vocab 32000) is created locally in one process (TP1). Measured in the
same run:

  export   iterate export_hf_weights() over the whole model (buckets of --bucket-mb), consuming
           each bucket (no disk); reference: a plain memory copy of every parameter's bytes,
           which is the physical limit of an in-memory export on this machine.
  import   load_hf_weights() from a safetensors directory on disk (page cache warm, as the files
           were just written); references: the same memory copy, and safetensors.load_file of
           the same files (reading every byte, no layout work).

Each throughput is printed in GB/s and as a ratio to its reference; peak extra memory is the
sampled peak of anonymous RSS above the state before the step (benchmarks/peak_memory.py).
glibc raises its mmap threshold as large blocks are freed and then keeps later ones in the heap,
so RSS would count freed memory too (TP2 export showed 1305 MiB instead of 525 MiB of live
data); the script pins MALLOC_MMAP_THRESHOLD_ (re-executing itself once) so the peak reflects
live memory. That makes every large allocation a fresh mapping: throughputs are a little
pessimistic.

    .venv/bin/python benchmarks/bridge_export.py [--layers 8 --hidden 1024 --experts 16 --bucket-mb 512]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch  # noqa: E402

from peak_memory import PeakAnonMemory  # noqa: E402

GB = 1e9


def model_config(args) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": args.vocab, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": args.hidden // 16,
        "intermediate_size": args.hidden * 3, "moe_intermediate_size": args.hidden,
        "num_experts": args.experts, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "tie_word_embeddings": False, "hidden_act": "silu",
    }


def timed(fn) -> tuple[float, int]:
    """Seconds and peak extra anonymous memory (bytes) of fn()."""
    memory = PeakAnonMemory()
    memory.start()
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started, memory.peak_bytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel ranks (started with torchrun)")
    parser.add_argument("--quick", action="store_true", help="a small model for a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.hidden, args.experts, args.vocab, args.bucket_mb = 2, 256, 4, 1000, 4
    if "RANK" not in os.environ and (args.tp > 1 or "MALLOC_MMAP_THRESHOLD_" not in os.environ):
        from megatron_rl.runtime.distributed import free_port

        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576", OMP_NUM_THREADS=str(max(1, 2 // args.tp)))
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.tp}",
                   f"--master-port={free_port()}", __file__, *sys.argv[1:]]
        sys.exit(subprocess.call(command, env=env))

    from safetensors.torch import load_file

    from megatron_rl.checkpoint.atomic_dir import AtomicDirectory
    from megatron_rl.bridge import export_hf_weights, load_hf_weights
    from megatron_rl.bridge.hf_checkpoint import write_hf_checkpoint
    from megatron_rl.config import load_config
    from megatron_rl.model.builder import build_model
    from megatron_rl.runtime import start_runtime

    # One scratch name for all ranks: under torchrun they share the launcher as parent.
    config_dir = Path(tempfile.gettempdir()) / f"bridge-bench-config-{os.getppid() if 'RANK' in os.environ else os.getpid()}"
    config_dir.mkdir(exist_ok=True)
    (config_dir / "config.json").write_text(json.dumps(model_config(args)))
    config = load_config(None, ["device=cpu", f"model.hf_config={config_dir}", f"parallel.tp={args.tp}"])
    runtime = start_runtime(config)
    built = build_model(config, runtime.device)
    params = list(built.module.parameters())
    local_bytes = sum(p.numel() * p.element_size() for p in params)
    bucket_bytes = args.bucket_mb << 20
    exported = [0]

    def copy_all():
        for p in params:
            torch.empty_like(p).copy_(p)

    def export_all(dtype=None):
        exported[0] = 0
        for bucket in export_hf_weights(built.module, built.arch, bucket_bytes=bucket_bytes, dtype=dtype):
            exported[0] += sum(t.numel() * t.element_size() for _, t in bucket)
            del bucket

    def gather_all():  # the transport alone: the same collectives with no layout work
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
        for p in params:
            if getattr(p, "tensor_model_parallel", False):
                out = [torch.empty_like(p) for _ in range(group.size())]
                dist.all_gather(out, p.detach().contiguous(), group=group)

    copy_all()  # warm up the allocator and the pages once
    copy_s, copy_mem = timed(copy_all)
    gather_s, _ = timed(gather_all) if args.tp > 1 else (None, 0)
    export_s, export_mem = timed(export_all)
    export_bytes = exported[0]
    bf16_s, bf16_mem = timed(lambda: export_all(torch.bfloat16))
    bf16_bytes = exported[0]

    hf_dir = Path(tempfile.gettempdir()) / f"{config_dir.name}-hf"
    with AtomicDirectory(hf_dir, force=True) as staging:
        write_hf_checkpoint(built.module, built.arch, built.raw_hf_config, staging, bucket_bytes=bucket_bytes)
    files = sorted(hf_dir.glob("*.safetensors"))
    hf_bytes = sum(f.stat().st_size for f in files)

    def read_all():  # every byte read once and copied out of the mapping
        for file in files:
            for tensor in load_file(file).values():
                torch.empty_like(tensor).copy_(tensor)

    read_s, read_mem = timed(read_all)
    import_s, import_mem = timed(lambda: load_hf_weights(built.module, built.arch, hf_dir))

    if runtime.is_driver:
        n_params = sum(p.numel() for p in params) * args.tp  # approximate for TP > 1 (norms replicated)
        print(f"model: ~{n_params / 1e6:.0f}M parameters, {hf_bytes / GB:.2f} GB fp32 ({args.layers} layers, "
              f"hidden {args.hidden}, {args.experts} experts, vocab {args.vocab}); bucket {args.bucket_mb} MiB; "
              f"TP{args.tp}; {torch.get_num_threads()} threads per rank; numbers from rank 0")
        print(f"{'step':<34}{'GB/s':>8}{'seconds':>10}{'peak extra anon MiB':>21}")
        rows = [
            ("memory copy of local params (ref.)", local_bytes, copy_s, copy_mem),
            *([("raw TP all_gather (ref.)", export_bytes, gather_s, 0)] if gather_s else []),
            ("export, native dtype", export_bytes, export_s, export_mem),
            ("export, cast to bf16", bf16_bytes, bf16_s, bf16_mem),
            ("safetensors read + copy (ref.)", hf_bytes, read_s, read_mem),
            ("import (bridge, own slices)", hf_bytes, import_s, import_mem),
        ]
        for name, size, seconds, peak in rows:
            print(f"{name:<34}{size / GB / seconds:>8.2f}{seconds:>10.2f}{peak / 2**20:>21.0f}")
        copy_rate = local_bytes / copy_s
        print(f"ratio export/memcpy throughput: native {export_bytes / export_s / copy_rate:.2f}, "
              f"bf16 {bf16_bytes / bf16_s / copy_rate:.2f}; export peak extra memory "
              f"{max(export_mem, bf16_mem) / 2**20:.0f} MiB (bound: one {args.bucket_mb} MiB bucket + one assembled tensor)")
        if gather_s:
            print(f"ratio export/raw all_gather throughput: native {gather_s / export_s:.2f}, bf16 {gather_s / bf16_s:.2f}")
        print(f"ratio import/memcpy throughput {hf_bytes / import_s / copy_rate:.2f}; "
              f"import/read+copy throughput {read_s / import_s:.2f}")
        print("note: at TP1 the native-dtype export yields views of the live parameters (no copy), "
              "so its rate measures per-tensor overhead only")
    runtime.shutdown()
    if runtime.is_driver:
        import shutil

        shutil.rmtree(hf_dir, ignore_errors=True)
        shutil.rmtree(config_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
