"""--force never deletes an input, and replaces only what the same command wrote before
(checkpoint/output_guard.py): `megatron-rl convert` both ways and `megatron-rl sft`, run through
their command-line entries in this process. Every refusal comes before anything is read or
written, so none of these builds a model: each takes milliseconds."""

from __future__ import annotations

import json

import pytest

from megatron_rl import cli
from megatron_rl.checkpoint.atomic_dir import AtomicDirectory
from megatron_rl.checkpoint.output_guard import MARKER
from megatron_rl.tools import convert


def listing(root) -> dict[str, str]:
    """Every file under `root` with its content: what must be unchanged after a refusal."""
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def run_dir(tmp_path):
    """A training run's directory as the trainer leaves it (metrics, a checkpoint named by `latest`),
    with a neighbour beside it."""
    run = tmp_path / "x" / "run"
    step = run / "checkpoints" / "step_000003"
    step.mkdir(parents=True)
    (step / "megatron_rl.json").write_text(json.dumps({"format": "megatron-rl"}))
    (run / "checkpoints" / "latest").write_text("step_000003\n")
    (run / "metrics.jsonl").write_text('{"step": 3}\n')
    (tmp_path / "x" / "neighbour.txt").write_text("keep me")
    return run


@pytest.fixture
def hf_dir(tmp_path):
    model = tmp_path / "models" / "hf"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (model / "model.safetensors").write_text("weights")
    return model


def refused(capsys, main, argv) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("out", ["parent", "run", "step", "inside_step"])
def test_megatron_to_hf_refuses_an_output_that_is_holds_or_lies_in_its_checkpoint(tmp_path, run_dir, capsys, out):
    """The audit's `--ckpt /tmp/x/run --out /tmp/x --force` removed the run and its neighbours."""
    step = run_dir / "checkpoints" / "step_000003"
    target = {"parent": run_dir.parent, "run": run_dir, "step": step, "inside_step": step / "hf"}[out]
    before = listing(tmp_path)
    err = refused(capsys, convert.main, ["megatron-to-hf", "--ckpt", str(run_dir), "--out", str(target), "--force"])
    relation = {"parent": "contains", "run": "is", "step": "is", "inside_step": "lies inside"}[out]
    assert f"output {target} {relation} the input" in err and "--force does not change that" in err, err
    assert listing(tmp_path) == before


def test_hf_to_megatron_refuses_its_own_input_also_through_a_link(tmp_path, hf_dir, capsys):
    before = listing(tmp_path)
    for target in (hf_dir, hf_dir.parent, hf_dir / "megatron"):
        err = refused(capsys, convert.main, ["hf-to-megatron", "--hf-dir", str(hf_dir), "--out", str(target), "--force"])
        assert f"the input --hf-dir {hf_dir}" in err, err
    assert listing(tmp_path) == before
    link = tmp_path / "link"
    link.symlink_to(hf_dir)
    err = refused(capsys, convert.main, ["hf-to-megatron", "--hf-dir", str(link), "--out", str(hf_dir), "--force"])
    assert f"output {hf_dir} is the input --hf-dir {link} (= {hf_dir})" in err, err
    assert (hf_dir / "model.safetensors").read_text() == "weights"


def test_force_leaves_alone_what_the_command_did_not_write(tmp_path, hf_dir, capsys):
    """A directory of anything else, or another command's output, is not replaced with --force."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "precious.txt").write_text("mine")
    err = refused(capsys, convert.main, ["hf-to-megatron", "--hf-dir", str(hf_dir), "--out", str(other), "--force"])
    assert f"output directory {other} already exists and it holds no {MARKER}" in err, err
    assert "it is left alone, also with --force" in err
    (other / MARKER).write_text(json.dumps({"command": "megatron-rl sft"}))
    err = refused(capsys, convert.main, ["hf-to-megatron", "--hf-dir", str(hf_dir), "--out", str(other), "--force"])
    assert "it was written by `megatron-rl sft`" in err, err
    assert (other / "precious.txt").read_text() == "mine"


def test_sft_force_does_not_wipe_a_training_run_or_its_input(tmp_path, run_dir, capsys):
    before = listing(tmp_path)
    err = refused(capsys, cli.main, ["sft", "--output-dir", str(run_dir), "--force"])
    assert f"output directory {run_dir} already exists and it holds no {MARKER}" in err, err
    step = run_dir / "checkpoints" / "step_000003"
    err = refused(capsys, cli.main, ["sft", "--output-dir", str(step), "--force", f"checkpoint.init_from={run_dir}"])
    assert f"output {step} is the input the checkpoint checkpoint.init_from names" in err, err
    err = refused(capsys, cli.main, ["sft", "--output-dir", str(run_dir.parent), "--force",
                                     f"checkpoint.init_from={run_dir}"])
    assert f"output {run_dir.parent} contains the input checkpoint.init_from" in err, err
    assert listing(tmp_path) == before


def test_force_replaces_the_commands_own_earlier_output(tmp_path):
    out = tmp_path / "out"
    for content in ("first", "second"):
        with AtomicDirectory(out, force=True, owner="megatron-rl sft") as staging:
            (staging / "weights.bin").write_text(content)
    assert (out / "weights.bin").read_text() == "second"
    assert json.loads((out / MARKER).read_text()) == {"command": "megatron-rl sft"}
    with pytest.raises(ValueError, match="written by `megatron-rl sft`"):
        with AtomicDirectory(out, force=True, owner="megatron-rl convert hf-to-megatron"):
            pass
    assert (out / "weights.bin").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
