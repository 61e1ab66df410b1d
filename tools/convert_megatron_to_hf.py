#!/usr/bin/env python
"""Megatron torch_dist checkpoint (written by megatron-rl) -> HF safetensors directory.

    python tools/convert_megatron_to_hf.py --ckpt DIR --out DIR [--hf-template DIR] [--bucket-mb 512] [--force]

The result loads with transformers.AutoModelForCausalLM.from_pretrained. The checkpoint may have
been saved at any layout; it is read in one process, --bucket-mb MiB of weights at a time, so the
memory needed does not grow with the model. Same as `megatron-rl convert megatron-to-hf ...`.
"""

import sys

from megatron_rl.tools.convert import main

if __name__ == "__main__":
    sys.exit(main(["megatron-to-hf", *sys.argv[1:]], prog=f"python {sys.argv[0]}"))
