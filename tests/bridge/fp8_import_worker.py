"""One rank of the FP8-import checks, started by torchrun: one model, several checkpoints.

The model is built once from --model (an HF directory's config.json); each step then runs on it,
in order (torchrun start-up costs more than all the loads together):

  load:NAME:DIR   zero every parameter, load_hf_weights from DIR (with the architecture DIR's own
                  config.json describes), write what was loaded as a plain HF checkpoint to
                  OUT/NAME; or, if the load is refused, the message to OUT/NAME.error
  fp8:NAME        write the current weights as an FP8 HF checkpoint to OUT/NAME (model.export_fp8's
                  writer, the format the importer reads back)

    python fp8_import_worker.py --model HF_DIR --out OUT_DIR --step load:orig:HF_DIR --step fp8:f [--override k=v ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.checkpoint.atomic_dir import AtomicDirectory
from megatron_rl.bridge import load_hf_weights
from megatron_rl.bridge.hf_checkpoint import write_hf_checkpoint
from megatron_rl.config import load_config
from megatron_rl.errors import ConfigError
from megatron_rl.model.builder import build_model
from megatron_rl.model.hf_config import load_hf_config, parse_hf_config
from megatron_rl.runtime import start_runtime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--step", action="append", default=[])
    parser.add_argument("--override", action="append", default=[])
    args = parser.parse_args()
    config = load_config(None, ["device=cpu", f"model.hf_config={args.model}", *args.override])
    runtime = start_runtime(config)
    out = Path(args.out)
    built = build_model(config, runtime.device)
    module = built.module
    for step in args.step:
        action, name, *rest = step.split(":", 2)
        if action == "fp8":
            with AtomicDirectory(out / name) as staging:
                write_hf_checkpoint(module, built.arch, built.raw_hf_config, staging, bucket_bytes=1 << 14, fp8=True)
            continue
        assert action == "load", step
        source = rest[0]
        raw, where = load_hf_config(source)
        arch = parse_hf_config(raw, where)
        with torch.no_grad():
            for _, param in module.named_parameters():
                param.zero_()
        try:
            load_hf_weights(module, arch, source)
        except ConfigError as exc:  # the importer's refusals are collective: every rank is here
            if dist.get_rank() == 0:
                (out / f"{name}.error").write_text(str(exc))
            continue
        with AtomicDirectory(out / name) as staging:
            write_hf_checkpoint(module, arch, raw, staging, bucket_bytes=1 << 14)
    dist.barrier()
    runtime.shutdown()


if __name__ == "__main__":
    main()
