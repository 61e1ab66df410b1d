"""One process of tests/bridge/test_peft_import.py: PEFT adapters converted with
`megatron-rl convert peft-to-megatron` and loaded into the LoRA policy as checkpoint.init_from.

    peft_import_worker.py CASE_DIR...

Each CASE_DIR holds base/ (the HF model), adapter/ (the PEFT adapter) and lora.json (the run's
model.lora overrides). The worker converts it into CASE_DIR/ckpt, builds the policy with that
model.lora, loads the checkpoint with load_initial_weights (the run's own path) and saves to
CASE_DIR/result.pt the Megatron logits of TOKENS and the policy's adapters, whole:
{global weight name: (A, B)}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

TOKENS = [3, 17, 42, 99, 7, 250, 12, 5, 64, 31]


def main(cases: list[Path]) -> None:
    from megatron_rl.bridge.placement import placements
    from megatron_rl.checkpoint.format import load_initial_weights, pin_checkpoint_vocab
    from megatron_rl.config import load_config
    from megatron_rl.model.policy import Policy
    from megatron_rl.runtime import start_runtime
    from megatron_rl.tools.convert import main as convert
    from megatron_rl.tools.verify_hf import megatron_logits

    for case in cases:
        code = convert(["peft-to-megatron", "--hf", str(case / "base"), "--adapter", str(case / "adapter"),
                        "--out", str(case / "ckpt")])
        assert code == 0, f"peft-to-megatron {case}: exit {code}"
    runtime = None
    for case in cases:
        overrides = ["device=cpu", f"model.hf_config={case / 'ckpt' / 'hf_config'}", f"checkpoint.init_from={case / 'ckpt'}",
                     *json.loads((case / "lora.json").read_text())]
        config = pin_checkpoint_vocab(load_config(None, overrides))
        runtime = runtime or start_runtime(config)
        policy = Policy(config, runtime)
        load_initial_weights(policy, str(case / "ckpt"))
        logits = megatron_logits(policy.module, policy.arch, config, runtime, [TOKENS])
        adapters = {p.global_name: (p.adapter[0].detach().clone(), p.adapter[1].detach().clone())
                    for p in placements(policy.module) if p.adapter is not None}
        torch.save({"logits": logits, "adapters": adapters}, case / "result.pt")


if __name__ == "__main__":
    main([Path(arg) for arg in sys.argv[1:]])
