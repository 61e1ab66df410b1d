"""The model directory a rollout engine starts from: config.json, generation_config.json and the
tokenizer, no weights (engines start with dummy weights; the trainer pushes its own before the
first rollout).

One function for every engine, whoever starts it: the trainer for the engines it runs itself
(OUTPUT_DIR/engine_model) and `megatron_rl.launch.rollout_node` for a server on a rollout node of
a SLURM job. The engine must see the same config.json in both cases, else a server on its own node
would build another model than the trainer pushes weights for.
"""

from __future__ import annotations

import json
from pathlib import Path


def engine_config(config) -> dict:
    """config.json for the engines of a run (`config`: a RunConfig): model.hf_config's, with the
    keys transformers implies but engines read explicitly (hf_config.with_implied_keys), and the
    `quantization_config` of the weights the engines receive: block-wise FP8 with
    model.export_fp8, else none, even when the model came from an FP8 checkpoint (DeepSeek-V3 is
    published so): weight sync then pushes the training precision."""
    from megatron_rl.bridge.fp8_export import with_quantization_config
    from megatron_rl.model.hf_config import load_hf_config, parse_hf_config, with_implied_keys

    raw, where = load_hf_config(config.model.hf_config)
    arch = parse_hf_config(raw, where)
    return with_quantization_config(with_implied_keys(raw, arch), arch, fp8=config.model.export_fp8)


def write_engine_model_dir(config, directory: str | Path) -> Path:
    """Write the engine's model directory for `config` into `directory` (created if needed)."""
    from megatron_rl.checkpoint.format import write_run_tokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    raw = engine_config(config)
    (directory / "config.json").write_text(json.dumps(raw, indent=1))
    generation = {key: raw[key] for key in ("bos_token_id", "eos_token_id") if key in raw}
    (directory / "generation_config.json").write_text(json.dumps(generation))
    write_run_tokenizer(config, directory)
    return directory


def load_engine_tokenizer(directory: str | Path):
    """The tokenizer of an engine model directory, which every rank decodes and encodes with;
    refused without an EOS token (responses could never stop)."""
    from transformers import AutoTokenizer

    from megatron_rl.errors import ConfigError

    tokenizer = AutoTokenizer.from_pretrained(directory)
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"the tokenizer in {directory} has no EOS token; responses could never stop")
    return tokenizer
