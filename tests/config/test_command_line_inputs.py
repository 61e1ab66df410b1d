"""Small command-line faults, each refused by name instead of a traceback or a wrong answer: a
value given on the command line is reported as from there (not from "defaults"); `plan`'s flags
that the push time divides by, or that make no sense below 1; a config.json value of the wrong
kind; `convert --help` and its commands' usage. All through the entry points, in this process."""

from __future__ import annotations

import json

import pytest

from megatron_rl import cli
from megatron_rl.config import load_config
from megatron_rl.errors import ConfigError
from megatron_rl.model.hf_config import load_hf_config
from megatron_rl.tools import convert


def test_a_command_line_value_is_named_as_from_the_command_line(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config(None, ["rl.group_size=4", "rl.steps=-1"])
    assert str(error.value) == "command line (rl.steps=-1): rl.steps must be >= 1, got -1"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("rl:\n  steps: -3\n")
    with pytest.raises(ConfigError) as error:  # the file's own value: the file is named
        load_config(recipe, ["rl.group_size=4"])
    assert str(error.value) == f"{recipe}: rl.steps must be >= 1, got -3"
    with pytest.raises(ConfigError, match=r"^command line \(rl\.stepz=3\): unknown key 'rl\.stepz'"):
        load_config(recipe, ["rl.stepz=3", "rl.steps=2"])


PLAN = ["plan", "--gpus", "8", "--hf-config", "qwen3-30b-a3b", "device=cuda"]


@pytest.mark.parametrize("flags, message", [
    (["--nvlink-gbs", "0"], "--nvlink-gbs must be a bandwidth above 0 GB/s, got 0.0"),
    (["--nvlink-gbs", "nan"], "--nvlink-gbs must be a bandwidth above 0 GB/s, got nan"),
    (["--ib-gbs-per-node", "-5"], "--ib-gbs-per-node must be a bandwidth above 0 GB/s, got -5.0"),
    (["--top", "-1"], "--top must be at least 1 (layouts shown in the table), got -1"),
])
def test_plan_refuses_flags_it_cannot_plan_with(capsys, flags, message):
    assert cli.main([*PLAN, *flags]) == 2
    assert f"megatron-rl: configuration error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("key, value, kind", [("hidden_size", "banana", "a positive integer"),
                                              ("num_hidden_layers", 2.5, "a positive integer"),
                                              ("rms_norm_eps", "tiny", "a finite number")])
def test_plan_refuses_a_config_json_value_of_the_wrong_kind_by_name(tmp_path, capsys, key, value, kind):
    raw, _ = load_hf_config("qwen3-30b-a3b")
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, **{key: value})))
    assert cli.main(["plan", "--gpus", "8", "--hf-config", str(tmp_path), "device=cuda"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'config.json'}: {key}={value!r} must be {kind}" in err, err


def test_convert_help_exits_0_and_each_command_names_its_program(capsys):
    assert cli.main(["convert", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: megatron-rl convert {hf-to-megatron,megatron-to-hf,megatron-to-peft,peft-to-megatron} ...")
    assert "hf-to-megatron  HF safetensors directory -> Megatron torch_dist checkpoint" in out
    assert "megatron-to-peft  a LoRA run's adapters as a PEFT directory" in out
    assert "peft-to-megatron  a PEFT adapter and its HF base as one Megatron checkpoint" in out
    for command in ("hf-to-megatron", "megatron-to-hf", "megatron-to-peft", "peft-to-megatron"):
        with pytest.raises(SystemExit) as exit_:
            convert.main([command, "--help"])
        assert exit_.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: megatron-rl convert {command} [-h]")
    assert convert.main([]) == 2  # no command: the usage, on stderr
    assert capsys.readouterr().err.startswith("usage: megatron-rl convert")
