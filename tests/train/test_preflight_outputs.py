"""Preflight refusals of a run that would do its work and then fail, each before any model, process
group or engine exists, in this process:
- a rollout.max_model_len (or a teacher server's context) beyond the model's: vLLM refuses it at
  engine start, after the warm start;
- an output directory, checkpoints/ or a file the run appends to that cannot be written: the first
  save failed after a step's work. Root ignores permission bits, so an immutable directory
  (chattr +i) stands for it where it can be made, a read-only mode where the tests run as another
  user, and a path through a regular file everywhere."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.errors import ConfigError
from megatron_rl.model.hf_config import load_hf_config
from megatron_rl.rollout.engine_model import write_engine_model_dir
from megatron_rl.train.preflight import check_layout_and_paths, preflight

FAST = ["logging.wandb_mode=disabled", "device=cpu"]


def model_dir(root: Path, **changes) -> Path:
    raw, _ = load_hf_config("tiny-llama")
    raw.update(changes)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(raw))
    return root


def test_a_context_longer_than_the_models_is_refused_naming_both_values(tmp_path):
    short = model_dir(tmp_path / "short", max_position_embeddings=512)
    with pytest.raises(ConfigError) as refused:
        check_layout_and_paths(load_config(None, [f"model.hf_config={short}"]))
    assert str(refused.value) == (
        f"rollout.max_model_len=1024 is longer than the model's context: max_position_embeddings=512 in "
        f"{short / 'config.json'}. The rollout engine refuses a context beyond the model's when it starts (after "
        f"the warm start). Set rollout.max_model_len=512 or lower (prompts then get up to 506 tokens next to "
        f"rl.max_response_tokens=6), or use a model with a longer context")
    check_layout_and_paths(load_config(None, [f"model.hf_config={short}", "rollout.max_model_len=512"]))
    # no context key at all: the engine gets transformers' default for the family (Llama: 2048)
    raw, _ = load_hf_config("tiny-llama")
    raw.pop("max_position_embeddings")
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "config.json").write_text(json.dumps(raw))
    check_layout_and_paths(load_config(None, [f"model.hf_config={tmp_path / 'none'}", "rollout.max_model_len=2048"]))
    with pytest.raises(ConfigError, match=r"rollout.max_model_len=4096 is longer than the model's context: 2048, the "
                                          r"default of its family \(.*config.json names none of"):
        check_layout_and_paths(load_config(None, [f"model.hf_config={tmp_path / 'none'}",
                                                  "rollout.max_model_len=4096"]))


def test_a_teacher_server_whose_context_is_shorter_than_it_would_be_started_with_is_refused(tmp_path):
    """The teacher holds the student's 1024-token sequences, but its server would be started with
    1025 (the one token a prompt-logprobs request needs), which vLLM refuses for a 1024-position model."""
    teacher = write_engine_model_dir(load_config(), tmp_path / "teacher")
    raw = json.loads((teacher / "config.json").read_text())
    (teacher / "config.json").write_text(json.dumps(dict(raw, max_position_embeddings=1024)))
    config = load_config(None, [f"output_dir={tmp_path / 'run'}", *FAST, f"rl.teacher.source={teacher}"])
    with pytest.raises(ConfigError) as refused:
        preflight(config)
    assert str(refused.value).startswith(
        "rl.teacher.max_model_len=null serves rollout.max_model_len + 1 = 1025 tokens (the student's longest sequence "
        f"plus the token a prompt-logprobs request needs), which is longer than the teacher's context: "
        f"max_position_embeddings=1024 in {teacher / 'config.json'}; the teacher's engine would refuse to start. "
        "lower rollout.max_model_len to 1023 or less"), refused.value
    assert not (tmp_path / "run" / "logs").exists()


def _immutable(path: Path) -> str | None:
    """Make `path` unwritable for this process as the machine allows: how (for the test's own
    record), or None when it cannot (root without the immutable attribute)."""
    if os.geteuid() != 0:
        path.chmod(0o555 if path.is_dir() else 0o444)
        return "mode"
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0:
        return "chattr"
    return None


def _writable_again(path: Path, how: str | None) -> None:
    if how == "chattr":
        subprocess.run(["chattr", "-i", str(path)], check=True)
    elif how == "mode":
        path.chmod(0o755 if path.is_dir() else 0o644)


def refusal(out: Path) -> str:
    with pytest.raises(ConfigError) as refused:
        preflight(load_config(None, [f"output_dir={out}", *FAST, "warm_start.steps=0"]))
    return str(refused.value)


def test_checkpoints_and_files_the_run_cannot_write_are_refused_by_name_before_any_work(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    for path, what in ((out / "checkpoints", "the run's checkpoints"), (out / "metrics.jsonl", "every step's metrics")):
        how = _immutable(path)
        try:
            if how is not None:
                message = refusal(out)
                assert message.startswith(f"cannot write {path} ({what}): "), message
                assert "Operation not permitted" in message or "Permission denied" in message, message
                assert message.endswith("make it writable (an immutable file or directory: lsattr, chattr -i; a "
                                        "read-only mount; permissions) or pass another --output-dir"), message
        finally:
            _writable_again(path, how)
    # wherever the tests run: the run's directory through a regular file
    (tmp_path / "file").write_text("")
    message = refusal(tmp_path / "file" / "run")
    assert message.startswith(f"cannot write {tmp_path / 'file' / 'run'} (the run's output directory: run.json, "
                              f"metrics.jsonl, run_state.json): {tmp_path / 'file'} is not a directory"), message
    # and a checkpoints/ that is a file
    (out / "checkpoints").rmdir()
    (out / "checkpoints").write_text("")
    assert refusal(out).startswith(f"cannot write {out / 'checkpoints'} (the run's checkpoints): "
                                   f"{out / 'checkpoints'} is not a directory")
    # a FIFO where metrics.jsonl belongs: opening it to append blocked preflight forever
    (out / "checkpoints").unlink()
    (out / "metrics.jsonl").unlink()
    os.mkfifo(out / "metrics.jsonl")
    assert refusal(out).startswith(f"cannot write {out / 'metrics.jsonl'} (every step's metrics): "
                                   f"{out / 'metrics.jsonl'} is not a regular file (a FIFO, device or socket)")


def test_a_lora_rank_above_the_narrowest_adapted_layer_is_refused_by_name():
    """rank 2,000,000 held 6.15 GB after 10 s (10^9: an allocator traceback); the config bounds it,
    and preflight bounds it by the model: B A has rank at most min(in, out) of its layer."""
    check_layout_and_paths(load_config(None, ["model.lora.rank=64"]))  # tiny Qwen3-MoE: hidden 64
    with pytest.raises(ConfigError) as refused:
        check_layout_and_paths(load_config(None, ["model.lora.rank=65"]))
    assert str(refused.value) == (
        "model.lora.rank=65 is above the width of the narrowest layer it adapts, qkv: linear_qkv (64 in, 256 out, in "
        "preset tiny-qwen3-moe): an adapter B A has rank at most min(in, out), so a larger rank only costs memory. "
        "Use model.lora.rank=64 or lower, or leave that layer out of model.lora.targets")
    with pytest.raises(ConfigError, match=r"rank=5 is above the width of the narrowest layer it adapts, router: router "
                                          r"\(64 in, 4 out"):
        check_layout_and_paths(load_config(None, ["model.lora.rank=5", "model.lora.targets=[qkv,router]"]))
    with pytest.raises(ConfigError, match=r"rank=33 is above .* qkv: linear_q_down_proj \(64 in, 32 out"):
        check_layout_and_paths(load_config(None, ["model.lora.rank=33", "model.hf_config=tiny-deepseek-v3"]))
