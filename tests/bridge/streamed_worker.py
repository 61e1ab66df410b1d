"""Run under torchrun by tests/bridge/test_streamed.py: the live model the streamed conversions
must agree with.

    streamed_worker.py --hf DIR --streamed DIR --live-out DIR --export FILE --tp N --ep N --etp N

1. The live model at this layout, filled from the HF checkpoint (`load_hf_weights`, as
   `checkpoint.init_from` does), saved with Megatron-Core's save of the live weights into
   --live-out: the files the streamed hf-to-megatron at the same layout must reproduce byte for byte.
2. A second live model at this layout, loaded from --streamed (a streamed conversion saved at
   another layout), exported to HF names: rank 0 saves the tensors to --export.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.bridge import export_hf_weights, load_hf_weights
from megatron_rl.checkpoint.format import load_megatron_weights, read_metadata, save_megatron_checkpoint
from megatron_rl.tools.ranks import hf_model_config, model_on_this_rank


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("hf", "streamed", "live_out", "export"):
        parser.add_argument(f"--{name.replace('_', '-')}", required=True)
    for name in ("tp", "ep", "etp"):
        parser.add_argument(f"--{name}", type=int, required=True)
    args = parser.parse_args()
    args.pp = 1
    config = hf_model_config(args.hf, args, "fp32")
    with model_on_this_rank(config, initialize=False) as (runtime, built):
        load_hf_weights(built.module, built.arch, args.hf)
        save_megatron_checkpoint(built.module, built.raw_hf_config, Path(args.live_out), config, tokenizer_dir=None,
                                 source="live")
        rows = read_metadata(args.streamed)["padded_vocab_size"]
        assert rows == built.module.vocab_size, (rows, built.module.vocab_size)  # same padding at both layouts
        with torch.no_grad():
            for param in built.module.parameters():
                param.zero_()  # what the load must overwrite
        load_megatron_weights(built.module, Path(args.streamed))
        exported = {name: tensor.clone() for bucket in export_hf_weights(built.module, built.arch)
                    for name, tensor in bucket}
        if dist.get_rank() == 0:
            torch.save(exported, args.export)


if __name__ == "__main__":
    main()
