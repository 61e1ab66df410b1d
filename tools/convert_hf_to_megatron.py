#!/usr/bin/env python
"""HF safetensors directory -> Megatron torch_dist checkpoint at a chosen layout.

    python tools/convert_hf_to_megatron.py --hf-dir DIR --out DIR [--tp N --pp N --ep N --etp N] [--force]

Needs more than one rank for TP/PP/EP > 1 and starts them itself with torchrun.
Same as `megatron-rl convert hf-to-megatron ...`.
"""

import sys

from megatron_rl.tools.convert import main

if __name__ == "__main__":
    sys.exit(main(["hf-to-megatron", *sys.argv[1:]], prog=f"python {sys.argv[0]}"))
