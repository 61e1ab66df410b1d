"""One process of tests/bridge/test_peft_export.py: LoRA checkpoints of a one-process policy written
by the trainer's own writers, then `megatron-rl convert megatron-to-peft` (and peft-to-megatron)
on them.

    peft_export_worker.py CASE_DIR

CASE_DIR holds hf/ (a Hugging Face model: model.hf_config of every run here) and hf_moe/ (GLM-4.5,
a router with an expert bias). The worker writes,
each with the LoRA policy's adapters made nonzero and the live merged export beside it
(merged_*/, what the run's hf_model/ holds):

    random/checkpoints/{base,step_000001}   a run from random initialization (checkpoint.base_weights
                                            referenced): the random base written as checkpoints/base/
    init_from/checkpoints/step_000001       a run from checkpoint.init_from=hf/: the checkpoint names it
    sft/                                    `megatron-rl sft`'s checkpoint of the random run's policy:
                                            base and adapters in one directory
    moe_{still,moved}/checkpoints/step_000001  GLM-4.5 from init_from=hf_moe/, its routers' expert bias
                                            as loaded, and moved
    moe_merge/checkpoints/{base,step_000001}  the same policy's base written as checkpoints/base/ (as a
                                            run from random initialization writes it) before the bias
                                            moved, step 1 after: `megatron-to-hf --merge-lora` of it

then runs the conversions into CASE_DIR/out/NAME (megatron-to-peft on each; peft-to-megatron of
the exports; megatron-to-peft of an imported checkpoint and of a run from it, from_imported/) and
records each one's exit code and error line in CASE_DIR/result.json.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import torch

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[qkv,proj,fc1,fc2]"]


def nonzero_adapters(policy, seed: int) -> None:
    """Every lora_B nonzero (A is already), as after some training."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.module.named_parameters():
            if name.endswith(".lora_B"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def save_merged(policy, directory: Path) -> None:
    from safetensors.torch import save_file

    from megatron_rl.bridge import export_hf_weights
    from megatron_rl.bridge.hf_checkpoint import write_hf_config

    merged = {n: t.contiguous() for bucket in export_hf_weights(policy.module, policy.arch, every_rank=True)
              for n, t in bucket}
    directory.mkdir()
    save_file(merged, str(directory / "model.safetensors"))
    write_hf_config(policy.raw_hf_config, policy.arch, directory, template_dir=None)


def training_checkpoint(policy, config, root: Path, base: dict) -> Path:
    """Step 1 of a run that refers to `base` (the trainer's metadata and writer: checkpoint/store.py)."""
    from megatron_rl.checkpoint import store
    from megatron_rl.checkpoint.format import FORMAT
    from megatron_rl.config.loader import to_dict

    metadata = {"format": FORMAT, "weights_dir": "weights", "padded_vocab_size": policy.module.vocab_size,
                "precision": config.model.precision, "source": str(root.parent.resolve()), "base": base}
    hf_files = {"config.json": json.dumps(policy.raw_hf_config).encode()}
    return store.begin_save(root, 1, policy, {"config": to_dict(config)}, keep_last=2, keyed_like_weights={},
                            metadata=metadata, hf_files=hf_files, async_save=False,
                            device=torch.device("cpu")).final


def checkpoints(case: Path) -> dict[str, str]:
    from megatron_rl.checkpoint import base_ref
    from megatron_rl.checkpoint.format import load_initial_weights, save_megatron_checkpoint
    from megatron_rl.config import load_config
    from megatron_rl.model.policy import Policy
    from megatron_rl.runtime import start_runtime

    hf = case / "hf"
    common = ["device=cpu", f"model.hf_config={hf}", *LORA]
    paths = {}
    config = load_config(None, common + [f"output_dir={case / 'random'}"])
    runtime = start_runtime(config)
    try:
        # A run from random initialization: its base is written once at the start (checkpoints/base/).
        policy = Policy(config, runtime)
        root = case / "random" / "checkpoints"
        root.mkdir(parents=True)
        base = base_ref.write_base(policy, root, config, model_dir=None)
        nonzero_adapters(policy, seed=1)
        paths["random"] = str(training_checkpoint(policy, config, root, base_ref.describe_written(
            base, relative_to=root / "step_000001")))
        save_merged(policy, case / "merged_random")
        # megatron-rl sft's checkpoint of the same policy (train/sft.py: base and adapters together).
        (case / "sft").mkdir()
        save_megatron_checkpoint(policy.module, policy.raw_hf_config, case / "sft", config, tokenizer_dir=None,
                                 source=f"random init (seed {config.seed})")
        paths["sft"] = str(case / "sft")
        # A run from checkpoint.init_from=hf/: the checkpoint refers to it (checkpoint/base_ref.py).
        config = load_config(None, common + [f"checkpoint.init_from={hf}", f"output_dir={case / 'init_from'}"])
        policy = Policy(config, runtime)
        load_initial_weights(policy, str(hf))
        nonzero_adapters(policy, seed=2)
        root = case / "init_from" / "checkpoints"
        root.mkdir(parents=True)
        paths["init_from"] = str(training_checkpoint(policy, config, root, base_ref.describe_source(hf)))
        save_merged(policy, case / "merged_init_from")
    finally:
        runtime.shutdown()
    paths.update(moe_checkpoints(case))
    return paths


def moe_checkpoints(case: Path) -> dict[str, str]:
    """GLM-4.5 (a router with an expert bias) from checkpoint.init_from=hf_moe/, LoRA on attention:
    step 1 as it loaded (moe_still) and after the routers' expert bias moved, as
    model.moe_router_bias_update_rate moves it (moe_moved)."""
    from megatron_rl.checkpoint import base_ref
    from megatron_rl.checkpoint.format import load_initial_weights
    from megatron_rl.config import load_config
    from megatron_rl.model.policy import Policy
    from megatron_rl.runtime import start_runtime

    hf = case / "hf_moe"
    config = load_config(None, ["device=cpu", f"model.hf_config={hf}", "model.lora.rank=4", "model.lora.alpha=8",
                                "model.lora.targets=[qkv,proj]", f"checkpoint.init_from={hf}",
                                f"output_dir={case / 'moe'}"])
    runtime = start_runtime(config)
    paths = {}
    try:
        policy = Policy(config, runtime)
        load_initial_weights(policy, str(hf))
        nonzero_adapters(policy, seed=3)
        merge_root = case / "moe_merge" / "checkpoints"
        merge_root.mkdir(parents=True)
        merge_base = base_ref.write_base(policy, merge_root, config, model_dir=None)  # the bias as loaded
        for name in ("moe_still", "moe_moved"):
            if name == "moe_moved":
                with torch.no_grad():
                    for buffer_name, buffer in policy.module.named_buffers():
                        if buffer_name.endswith("router.expert_bias"):
                            buffer.add_(0.05)
            root = case / name / "checkpoints"
            root.mkdir(parents=True)
            paths[name] = str(training_checkpoint(policy, config, root, base_ref.describe_source(hf)))
        # The bias moved since the base was written: the checkpoint holds it, the base the old one.
        paths["moe_merge"] = str(training_checkpoint(policy, config, merge_root, base_ref.describe_written(
            merge_base, relative_to=merge_root / "step_000001")))
        save_merged(policy, case / "merged_moe_merge")
    finally:
        runtime.shutdown()
    return paths


def convert(*argv: str) -> dict:
    from megatron_rl.tools.convert import main

    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        code = main([str(arg) for arg in argv])
    return {"code": code, "error": errors.getvalue().strip().splitlines()[-1:] or [""]}


def main(case: Path) -> None:
    paths = checkpoints(case)
    out = case / "out"
    out.mkdir()
    to_peft = "megatron-to-peft"
    result = {"paths": paths, "runs": {
        "random": convert(to_peft, "--ckpt", paths["random"], "--out", out / "random"),
        "random_write_base": convert(to_peft, "--ckpt", paths["random"], "--out", out / "random_write_base",
                                     "--write-base"),
        "init_from": convert(to_peft, "--ckpt", paths["init_from"], "--out", out / "init_from"),
        "init_from_write_base": convert(to_peft, "--ckpt", paths["init_from"], "--out",
                                        out / "init_from_write_base", "--write-base"),
        "sft": convert(to_peft, "--ckpt", paths["sft"], "--out", out / "sft"),
        "sft_write_base": convert(to_peft, "--ckpt", paths["sft"], "--out", out / "sft_write_base", "--write-base"),
    }}
    runs = result["runs"]
    for name in ("moe_still", "moe_moved"):
        runs[name] = convert(to_peft, "--ckpt", paths[name], "--out", out / name)
    runs["moe_merge"] = convert("megatron-to-hf", "--merge-lora", "--ckpt", paths["moe_merge"], "--out",
                                out / "moe_merge")
    # Back into Megatron: on the base the adapter names, and on another one.
    adapter = out / "random_write_base"
    runs["import_named_base"] = convert("peft-to-megatron", "--hf", adapter / "base", "--adapter", adapter,
                                        "--out", out / "import_named_base")
    runs["import_other_base"] = convert("peft-to-megatron", "--hf", case / "hf", "--adapter", adapter,
                                        "--out", out / "import_other_base")
    # The round trip on hf/: the init_from run's adapter imported on hf/ (the checkpoint holds hf/'s
    # weights, converted exactly) and exported again; then a run from that checkpoint, exported.
    runs["import_init_from"] = convert("peft-to-megatron", "--hf", case / "hf", "--adapter", out / "init_from",
                                       "--out", out / "import_init_from")
    runs["reexport"] = convert(to_peft, "--ckpt", out / "import_init_from", "--out", out / "reexport")
    paths["from_imported"] = from_imported(case, out / "import_init_from")
    runs["from_imported"] = convert(to_peft, "--ckpt", paths["from_imported"], "--out", out / "from_imported")
    (case / "result.json").write_text(json.dumps(result, indent=1))


def from_imported(case: Path, imported: Path) -> str:
    """A run from checkpoint.init_from=IMPORTED (`convert peft-to-megatron`'s checkpoint: the base
    referenced is that checkpoint), its adapters moved on, step 1 written; its live merged export
    in merged_from_imported/."""
    from megatron_rl.checkpoint import base_ref
    from megatron_rl.checkpoint.format import load_initial_weights, pin_checkpoint_vocab
    from megatron_rl.config import load_config
    from megatron_rl.model.policy import Policy
    from megatron_rl.runtime import start_runtime

    config = pin_checkpoint_vocab(load_config(None, ["device=cpu", f"model.hf_config={imported / 'hf_config'}", *LORA,
                                                     f"checkpoint.init_from={imported}",
                                                     f"output_dir={case / 'from_imported'}"]))
    runtime = start_runtime(config)
    try:
        policy = Policy(config, runtime)
        load_initial_weights(policy, str(imported))
        with torch.no_grad():  # the imported adapters, moved as a step would
            for name, param in policy.module.named_parameters():
                if name.endswith(".lora_B"):
                    param.mul_(1.5)
        root = case / "from_imported" / "checkpoints"
        root.mkdir(parents=True)
        ckpt = training_checkpoint(policy, config, root, base_ref.describe_source(imported))
        save_merged(policy, case / "merged_from_imported")
    finally:
        runtime.shutdown()
    return str(ckpt)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
