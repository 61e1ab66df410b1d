"""rl.teacher's start-up refusals (train/teacher.py, config/teacher.py), each naming its key, in
preflight before any model, engine or reward worker exists: a teacher with another vocabulary, a
teacher whose context cannot hold the student's sequences, an unknown mode, a distill_coef
without a teacher or outside (0, 1]; and a trainer-held teacher that the run's layout cannot
divide. In-process: a config.json and tokenizer files are all a refusal reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.errors import ConfigError
from megatron_rl.rollout.engine_model import write_engine_model_dir
from megatron_rl.train.preflight import preflight
from megatron_rl.train.teacher import check_teacher

FAST = ["logging.wandb_mode=disabled", "device=cpu"]


def teacher_dir(root: Path, *, positions: int | None = None, other_vocabulary: bool = False, **arch) -> Path:
    """A teacher's directory as the checks read it: the tiny default's config.json (with `arch`
    changes) and tokenizer files (the student's, or a word-level one of the same size)."""
    directory = write_engine_model_dir(load_config(), root / "teacher")
    raw = json.loads((directory / "config.json").read_text())
    raw.update(arch)
    if positions is not None:
        raw["max_position_embeddings"] = positions
    (directory / "config.json").write_text(json.dumps(raw))
    if other_vocabulary:
        import sys

        sys.path.insert(0, str(Path(__file__).parents[1] / "rollout"))
        from vocab_tokenizer import write_tokenizer

        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json"):
            (directory / name).unlink(missing_ok=True)
        write_tokenizer(directory, raw["vocab_size"])
    return directory


def refused(tmp_path, *overrides: str) -> str:
    config = load_config(None, [f"output_dir={tmp_path / 'run'}", *FAST, *overrides])
    with pytest.raises(ConfigError) as caught:
        preflight(config)
    assert not (tmp_path / "run" / "logs").exists()  # refused before anything started
    return str(caught.value)


def test_a_teacher_with_another_vocabulary_is_refused_by_name(tmp_path):
    source = teacher_dir(tmp_path, other_vocabulary=True)
    message = refused(tmp_path, f"rl.teacher.source={source}")
    assert "rl.teacher.source" in message and "another vocabulary" in message and "ids differ" in message, message


def test_a_teacher_too_short_for_the_student_is_refused_by_name(tmp_path):
    source = teacher_dir(tmp_path, positions=512)  # the student's sequences reach rollout.max_model_len = 1024
    for mode in ("trainer", "server"):
        message = refused(tmp_path, f"rl.teacher.source={source}", f"rl.teacher.mode={mode}")
        assert "rl.teacher.source" in message and "512 positions" in message, message
        assert "rollout.max_model_len=1024" in message, message
    # a server we start: its context must hold a sequence and the one token a request generates
    message = refused(tmp_path, f"rl.teacher.source={teacher_dir(tmp_path / 'long')}", "rl.teacher.max_model_len=1024")
    assert "rl.teacher.max_model_len=1024" in message and "at least 1025" in message, message


def test_unknown_mode_and_misplaced_keys_are_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match=r"rl\.teacher\.mode: 'offline' is not one of 'server', 'trainer'"):
        load_config(None, [f"rl.teacher.source={tmp_path}", "rl.teacher.mode=offline"])
    with pytest.raises(ConfigError, match=r"rl\.distill_coef=0\.5 has no effect without rl\.teacher"):
        load_config(None, ["rl.distill_coef=0.5"])
    with pytest.raises(ConfigError, match=r"rl\.distill_coef must be in \(0, 1\]"):
        load_config(None, [f"rl.teacher.source={tmp_path}", "rl.distill_coef=1.5"])
    with pytest.raises(ConfigError, match=r"rl\.teacher\.source is required"):
        load_config(None, ["rl.teacher.mode=trainer"])
    with pytest.raises(ConfigError, match=r"rl\.teacher\.server_url has no effect with rl\.teacher\.mode=trainer"):
        load_config(None, [f"rl.teacher.source={tmp_path}", "rl.teacher.mode=trainer",
                           "rl.teacher.server_url=http://127.0.0.1:1"])
    message = refused(tmp_path, f"rl.teacher.source={tmp_path / 'missing'}")
    assert message.startswith("rl.teacher.source:") and "does not exist" in message
    # DeepSeek-V3.2's sequence mask keys on the sample's reward advantage; distillation's are per token.
    with pytest.raises(ConfigError, match=r"rl\.off_policy\.opsm_delta with rl\.teacher"):
        load_config(None, [f"rl.teacher.source={tmp_path}", "rl.off_policy.opsm_delta=0.001"])
    load_config(None, [f"rl.teacher.source={tmp_path}", "rl.off_policy.method=icepop"])  # token masks combine


def test_a_trainer_held_teacher_the_layout_cannot_divide_is_refused(tmp_path):
    from megatron_rl.train.preflight import run_tokenizer

    source = teacher_dir(tmp_path, num_attention_heads=3, num_key_value_heads=1)
    config = load_config(None, [*FAST, f"rl.teacher.source={source}", "rl.teacher.mode=trainer", "parallel.tp=2"])
    with pytest.raises(ConfigError, match=r"rl\.teacher\.mode=trainer: the teacher .* does not fit the run's parallel"):
        check_teacher(config, run_tokenizer(config))


def test_the_teachers_dynamic_sampling_default_is_off():
    from megatron_rl.algorithms.from_config import recipe_for

    config = load_config(None, ["rl.teacher.source=x"])
    assert recipe_for(config.rl).dynamic_sampling is False  # dapo's default is on: equal-reward groups still teach
    config = load_config(None, ["rl.teacher.source=x", "rl.dynamic_sampling=true"])
    assert recipe_for(config.rl).dynamic_sampling is True


def test_a_teacher_config_json_that_is_not_an_object_or_holds_a_string_count_is_refused_by_name(tmp_path):
    """Its values are read before the architecture is (the context length): a list in place of the
    object, or a count that is a string, is a line naming rl.teacher.source and the file, not an
    AttributeError or TypeError."""
    from megatron_rl.train.preflight import run_tokenizer

    source = teacher_dir(tmp_path)
    config = load_config(None, [*FAST, f"rl.teacher.source={source}", "rl.teacher.mode=trainer"])
    for content, named in (([1, 2], "expected a JSON object (a Hugging Face config.json), got list"),
                           ({**json.loads((source / "config.json").read_text()), "max_position_embeddings": "4096"},
                            "max_position_embeddings='4096' must be a positive integer")):
        (source / "config.json").write_text(json.dumps(content))
        with pytest.raises(ConfigError) as caught:
            check_teacher(config, run_tokenizer(config))
        assert str(caught.value).startswith(f"rl.teacher.source: {source / 'config.json'}: {named}"), str(caught.value)


def test_a_lora_runs_checkpoint_as_the_teacher_is_refused_naming_the_teachers_key(tmp_path):
    """A trainer-held teacher is a whole model: a checkpoint of a LoRA run is refused naming
    rl.teacher.source and the merged export, not the student's checkpoint.init_from or model.lora
    (whatever the student's model.lora is)."""
    from megatron_rl.checkpoint.format import FORMAT, METADATA
    from megatron_rl.train.preflight import run_tokenizer

    ckpt = tmp_path / "lora_run_step"
    ckpt.mkdir()
    teacher_dir(tmp_path).rename(ckpt / "hf_config")
    metadata = {"format": FORMAT, "padded_vocab_size": 1024, "precision": "fp32"}
    (ckpt / METADATA).write_text(json.dumps(metadata))
    (ckpt / "trainer_state.json").write_text(json.dumps({"config": {"model": {"lora": {"rank": 4, "alpha": 8.0}}}}))
    for student in ([], ["model.lora.rank=8"]):
        config = load_config(None, [*FAST, f"rl.teacher.source={ckpt}", "rl.teacher.mode=trainer", *student])
        with pytest.raises(ConfigError) as caught:
            check_teacher(config, run_tokenizer(config))
        message = str(caught.value)
        assert message.startswith(f"rl.teacher.source: {ckpt} holds a LoRA run's adapters (rank 4, alpha 8.0)"), message
        assert "--merge-lora" in message and "checkpoint.init_from" not in message and "model.lora" not in message
    # and a value of the wrong type recorded there is named by its file and key
    (ckpt / "trainer_state.json").write_text(json.dumps({"config": {"model": {"lora": {"rank": 4, "alpha": "x"}}}}))
    with pytest.raises(ConfigError, match=r"^rl\.teacher\.source: .*trainer_state\.json: config\.model\.lora\.alpha: "
                                          r"expected a number, got 'x'"):
        check_teacher(config, run_tokenizer(config))
