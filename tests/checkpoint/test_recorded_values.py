"""Values the project reads back from files it (or a user, or a download) wrote are untrusted: a
value of the wrong type or out of bounds is one line naming the file and the key, never a
traceback from the code that uses it, nor an error blaming the command line its value was handed
to. megatron_rl.json (checkpoint/format.py read_metadata), a model.lora recorded in
trainer_state.json or megatron_rl.json, adapter_config.json's lora_alpha, trainer_state.json's
keys a resume reads, and a config.json that is not an object (model/hf_config.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_rl.checkpoint import format as ckpt_format
from megatron_rl.checkpoint.manifest import _inventory
from megatron_rl.checkpoint.store import MANIFEST, STATE, STATE_VERSION, verify
from megatron_rl.config import load_config
from megatron_rl.errors import ConfigError
from megatron_rl.rollout.engine_model import write_engine_model_dir

GOOD = {"format": ckpt_format.FORMAT, "padded_vocab_size": 640, "precision": "fp32"}


def checkpoint(root: Path, **fields) -> Path:
    """A converted checkpoint's files as its readers open them (no weights): megatron_rl.json
    (GOOD with `fields`; a None value removes the key) and hf_config/ (the tiny default's)."""
    root.mkdir(parents=True)
    metadata = {key: value for key, value in dict(GOOD, **fields).items() if value is not None}
    (root / ckpt_format.METADATA).write_text(json.dumps(metadata))
    write_engine_model_dir(load_config(), root / "hf_config")
    return root


@pytest.mark.parametrize("fields, named", [
    ({"padded_vocab_size": "640"}, "padded_vocab_size must be an integer from 1 to 33554432 (the embedding's rows), "
                                   "not '640'"),
    ({"padded_vocab_size": True}, "padded_vocab_size must be an integer"),
    ({"padded_vocab_size": 0}, "padded_vocab_size must be an integer"),
    ({"padded_vocab_size": 10**21}, "padded_vocab_size must be an integer"),
    ({"padded_vocab_size": None}, "padded_vocab_size must be an integer from 1 to 33554432 (the embedding's rows), "
                                  "not None"),
    ({"precision": "fp16"}, "precision must be one of 'fp32', 'bf16', not 'fp16'"),
    ({"precision": None}, "precision must be one of 'fp32', 'bf16', not None"),
    ({"lora": {"rank": "4"}}, "lora.rank: expected an integer, got '4'"),
    ({"lora": {"rank": 4, "alpha": math.inf}}, "lora.alpha must be a finite number"),
    ({"lora": {"rank": 4, "targets": ["mlp"]}}, "lora.targets[0]: 'mlp' is not one of"),
    ({"lora": [4]}, "lora: expected a mapping for LoraConfig, got [4]"),
    ({"base": [1]}, 'base names the base model wrongly ("base" must be an object with a "path")'),
    ({"base": {"path": "../base", "files": {"w.safetensors": {"bytes": "1", "crc32": "0"}}}},
     "base names the base model wrongly (file 'w.safetensors' needs \"bytes\" and \"crc32\")"),
], ids=["rows-text", "rows-bool", "rows-zero", "rows-huge", "rows-missing", "precision-other", "precision-missing",
        "lora-rank-text", "lora-alpha-inf", "lora-target-unknown", "lora-list", "base-list", "base-entry-text"])
def test_a_megatron_rl_json_value_of_the_wrong_kind_is_named_by_file_and_key(tmp_path, fields, named):
    ckpt = checkpoint(tmp_path / "ckpt", **fields)
    with pytest.raises(ConfigError) as caught:
        ckpt_format.read_metadata(ckpt)
    assert str(caught.value).startswith(f"{ckpt / ckpt_format.METADATA}: {named}"), str(caught.value)


def test_a_text_row_count_is_refused_before_the_model_is_built(tmp_path):
    """checkpoint.init_from's padded_vocab_size pins the student's (and a teacher's) embedding:
    a string was a TypeError in model/builder.py."""
    ckpt = checkpoint(tmp_path / "ckpt", padded_vocab_size="640")
    config = load_config(None, [f"checkpoint.init_from={ckpt}"])
    with pytest.raises(ConfigError, match=r"megatron_rl\.json: padded_vocab_size must be an integer"):
        ckpt_format.pin_checkpoint_vocab(config)
    assert ckpt_format.pin_checkpoint_vocab(load_config(None, [f"checkpoint.init_from={checkpoint(tmp_path / 'ok')}"])
                                            ).model.padded_vocab_size == 640


@pytest.mark.parametrize("recorded_in", ["trainer_state.json", "megatron_rl.json"])
def test_a_recorded_lora_alpha_is_named_by_its_file_not_the_command_line(tmp_path, capsys, recorded_in):
    """A LoRA run's model.lora becomes config overrides of the conversion (model.lora.alpha=...):
    a bad recorded value was blamed on the command line, and in checkpoint.init_from's check it
    failed formatting the message (ValueError: Unknown format code 'g')."""
    from megatron_rl.checkpoint.lora_record import check_run_lora
    from megatron_rl.model.hf_config import load_hf_config, parse_hf_config
    from megatron_rl.tools.convert import main as convert_main

    lora = {"rank": 4, "alpha": "abc"}
    if recorded_in == "trainer_state.json":
        ckpt = checkpoint(tmp_path / "ckpt")
        (ckpt / STATE).write_text(json.dumps({"config": {"model": {"lora": lora}}}))
        named = f"{ckpt / STATE}: config.model.lora.alpha: expected a number, got 'abc'"
    else:
        ckpt = checkpoint(tmp_path / "ckpt", lora=lora)
        named = f"{ckpt / ckpt_format.METADATA}: lora.alpha: expected a number, got 'abc'"
    for command in ("megatron-to-peft", "megatron-to-hf"):
        extra = ["--merge-lora"] if command == "megatron-to-hf" else []
        assert convert_main([command, "--ckpt", str(ckpt), "--out", str(tmp_path / command), *extra]) == 2
        error = capsys.readouterr().err
        assert error == f"megatron-rl convert: {named}\n", error
    arch = parse_hf_config(*load_hf_config(ckpt / "hf_config"))
    with pytest.raises(ConfigError) as caught:
        metadata = ckpt_format.read_metadata(ckpt)
        check_run_lora(ckpt, metadata, load_config(None, ["model.lora.rank=4"]).model.lora, arch)
    assert str(caught.value) == named


@pytest.mark.parametrize("alpha", [1e7, math.inf])
def test_an_adapter_config_lora_alpha_beyond_model_lora_is_named_by_its_file(tmp_path, alpha):
    """peft-to-megatron hands the adapter's r / lora_alpha to model.lora: a value model.lora
    refuses was blamed on the command line (model.lora.alpha=...)."""
    from megatron_rl.bridge.peft_import import read_adapter_config

    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": alpha}))
    with pytest.raises(ConfigError) as caught:
        read_adapter_config(tmp_path)
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / 'adapter_config.json'}: r, lora_alpha and lora_dropout are model.lora's "
                              "rank, alpha and dropout, and model.lora.alpha must be"), message
    assert "command line" not in message


def training_checkpoint(root: Path, state) -> Path:
    """A training checkpoint's files as verify() reads them: trainer_state.json and a manifest."""
    root.mkdir(parents=True)
    (root / STATE).write_text(json.dumps(state))
    (root / MANIFEST).write_text(json.dumps({"files": _inventory(root)}))
    return root


@pytest.mark.parametrize("state, named", [
    ([1], "trainer_state.json is not the JSON object a run writes (a list)"),
    ({"step": "3"}, "trainer_state.json: 'step' must be an integer >= 0, not \"3\""),
    ({"step": -1}, "trainer_state.json: 'step' must be an integer >= 0, not -1"),
    ({}, "trainer_state.json: 'step' must be an integer >= 0, not null"),
    ({"step": 3, "world_size": 0}, "trainer_state.json: 'world_size' must be an integer >= 1, not 0"),
    ({"step": 3, "policy": [1]}, "trainer_state.json: 'policy' must be an object, not [1]"),
    ({"step": 3, "sampler": "x"}, "trainer_state.json: 'sampler' must be an object, not \"x\""),
    ({"step": 3, "config": 1}, "trainer_state.json: 'config' must be an object, not 1"),
])
def test_a_trainer_state_a_resume_cannot_read_is_named_by_its_key(tmp_path, state, named):
    """verify() is what resume runs on every candidate (checkpoint.resume=auto skips it naming why)."""
    state = dict(state, version=STATE_VERSION) if isinstance(state, dict) else state
    assert verify(training_checkpoint(tmp_path / "step_000003", state)) == named
    assert verify(training_checkpoint(tmp_path / "good", {"step": 3, "version": STATE_VERSION, "world_size": 1,
                                                           "policy": {}, "sampler": {}, "config": {}})) is None


@pytest.mark.parametrize("content, named", [
    (b"[1, 2]", "expected a JSON object (a Hugging Face config.json), got list"),
    (b"\xff\xfe{}", "not valid JSON"),
    (b"[" * 100_000, "not valid JSON"),
])
def test_a_config_json_that_is_not_an_object_is_named_by_its_file(tmp_path, content, named):
    """Every config.json reader (model.hf_config, a teacher, verify-hf, plan) goes through
    load_hf_config, which hands back an object or refuses the file."""
    from megatron_rl.model.hf_config import load_hf_config

    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ConfigError) as caught:
        load_hf_config(tmp_path)
    assert str(caught.value).startswith(f"{tmp_path / 'config.json'}: {named}"), str(caught.value)
