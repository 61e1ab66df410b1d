"""ckpt_format.resolve_checkpoint and friends, on checkpoint directories made by hand: the four forms
`--ckpt` and `checkpoint.init_from` accept, and errors that say what is wrong and what to pass."""

import json
from pathlib import Path

import pytest

from megatron_rl.checkpoint import format as ckpt_format
from megatron_rl.tools.convert import main as convert_main
from megatron_rl.config import load_config
from megatron_rl.errors import ConfigError


def make_checkpoint(path: Path, weights_dir: str | None = None, vocab: int = 640) -> Path:
    """A directory with megatron_rl.json (and the weights directory it names); no real weights."""
    path.mkdir(parents=True)
    metadata = {"format": ckpt_format.FORMAT, "padded_vocab_size": vocab, "precision": "fp32"}
    if weights_dir is not None:
        metadata["weights_dir"] = weights_dir
        (path / weights_dir).mkdir()
    (path / ckpt_format.METADATA).write_text(json.dumps(metadata))
    (path / "hf_config").mkdir()
    return path


def make_run(run: Path, steps=(10, 20), latest: str | None = "step_000020") -> Path:
    for step in steps:
        make_checkpoint(run / "checkpoints" / f"step_{step:06d}", weights_dir="weights", vocab=step)
    (run / "checkpoints").mkdir(parents=True, exist_ok=True)
    if latest is not None:
        (run / "checkpoints" / "latest").write_text(latest + "\n")
    return run


def test_converted_checkpoint_is_itself(tmp_path):
    ckpt = make_checkpoint(tmp_path / "mcore")
    assert ckpt_format.resolve_checkpoint(ckpt) == ckpt
    assert ckpt_format.weights_path(ckpt) == ckpt  # no weights_dir: the weights are beside megatron_rl.json


def test_step_directory_weights_dir(tmp_path):
    step = make_run(tmp_path / "run")/ "checkpoints" / "step_000010"
    assert ckpt_format.resolve_checkpoint(step) == step
    assert ckpt_format.weights_path(step) == step / "weights"


@pytest.mark.parametrize("given", ["run", "run/checkpoints"])
def test_run_and_checkpoints_directories_resolve_to_latest(tmp_path, given):
    make_run(tmp_path / "run")
    resolved = ckpt_format.resolve_checkpoint(tmp_path / given)
    assert resolved == tmp_path / "run" / "checkpoints" / "step_000020"
    assert ckpt_format.read_metadata(resolved)["padded_vocab_size"] == 20


def test_init_from_a_run_directory_pins_its_vocab(tmp_path):
    make_run(tmp_path / "run")
    config = load_config(None, [f"checkpoint.init_from={tmp_path / 'run'}"])
    assert ckpt_format.pin_checkpoint_vocab(config).model.padded_vocab_size == 20
    assert ckpt_format.names_megatron_checkpoint(tmp_path / "run")
    assert not ckpt_format.names_megatron_checkpoint(tmp_path)  # e.g. a Hugging Face model directory


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda root: None, "does not exist"),
        (lambda root: root.write_text("x"), "is a file; pass the checkpoint directory"),
        (lambda root: root.mkdir(), "is not a megatron-rl checkpoint: it holds no megatron_rl.json"),
        (lambda root: make_run(root, steps=(), latest=None), "has no checkpoints yet"),
        (lambda root: make_run(root, latest=None), "latest does not exist, so the newest checkpoint is unknown; "
                                                     "pass a step directory instead, e.g. "),
        (lambda root: make_run(root, latest="step_000030"), "latest names step_000030, but"),
        (lambda root: make_run(root, latest="../elsewhere"), "should hold the name of a step directory"),
        (lambda root: (make_run(root), (root / "checkpoints" / "step_000020" / "megatron_rl.json").unlink()),
         "step_000020 holds no megatron_rl.json"),
    ],
    ids=["missing", "file", "plain-directory", "no-checkpoints-yet", "no-latest", "latest-dangling",
         "latest-escapes", "step-without-metadata"],
)
def test_errors(tmp_path, setup, message):
    root = tmp_path / "run"
    setup(root)
    with pytest.raises(ConfigError) as info:
        ckpt_format.resolve_checkpoint(root)
    assert message in str(info.value) and str(root) in str(info.value)


@pytest.mark.parametrize(
    "weights_dir, message",
    [("/abs", "weights_dir must be a path inside"), ("../up", "weights_dir must be a path inside"),
     ("gone", "weights_dir 'gone' does not exist")],
)
def test_bad_weights_dir(tmp_path, weights_dir, message):
    ckpt = make_checkpoint(tmp_path / "step", weights_dir="weights")
    metadata = json.loads((ckpt / ckpt_format.METADATA).read_text())
    (ckpt / ckpt_format.METADATA).write_text(json.dumps(dict(metadata, weights_dir=weights_dir)))
    with pytest.raises(ConfigError, match=message):
        ckpt_format.weights_path(ckpt)


def test_damaged_training_checkpoint_is_refused(tmp_path, monkeypatch):
    from megatron_rl.checkpoint import store as checkpoint

    step = make_run(tmp_path / "run") / "checkpoints" / "step_000020"
    ckpt_format.check_intact(step)  # no MANIFEST.json: a converted checkpoint, nothing to verify
    (step / ckpt_format.MANIFEST).write_text("{}")
    monkeypatch.setattr(checkpoint, "verify", lambda path: f"file weights/__0_0.distcp is corrupt (in {path.name})")
    with pytest.raises(ConfigError, match="step_000020 is damaged: file weights/__0_0.distcp is corrupt "
                                          r"\(in step_000020\); use another checkpoint"):
        ckpt_format.check_intact(step)


def test_megatron_to_hf_refuses_a_damaged_step_before_starting(tmp_path, capsys):
    """The real verify: MANIFEST.json lists a file the step directory does not have."""
    step = make_run(tmp_path / "run") / "checkpoints" / "step_000020"
    (step / ckpt_format.MANIFEST).write_text(json.dumps({"step": 20, "files": {"weights/__0_0.distcp": 10}}))
    assert convert_main(["megatron-to-hf", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {step} is damaged: " in err and "weights/__0_0.distcp" in err
    assert not (tmp_path / "hf").exists()
