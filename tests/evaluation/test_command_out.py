"""`megatron-rl eval --out DIR` loses nothing already written: a report an earlier evaluation
wrote there is replaced only with --overwrite, and a training run's directory (whose
engine_model/ eval would rewrite, under a live run too) is refused even then. Before, both were
overwritten without a word. Each case runs the CLI in this process; the engine stage fails the
test if reached, or (--overwrite) records that it was."""

from __future__ import annotations

import pytest

from megatron_rl import cli
from megatron_rl.evaluation import command
from stand_ins import refused


def test_an_earlier_report_is_kept_unless_overwrite_is_given(no_engine, capsys, hf_dir, prompts, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "eval.json").write_text('{"an earlier": "report"}')
    (out / "pass_at_k.png").write_bytes(b"png")
    err = refused(capsys, "--ckpt", str(hf_dir), "--set", f"add={prompts}", "--out", str(out))
    assert f"--out {out} already holds eval.json, pass_at_k.png, an earlier evaluation's report: pass another " \
           "--out to keep it, or --overwrite to replace it" in err, err
    assert (out / "eval.json").read_text() == '{"an earlier": "report"}'

    command._check_out(out, overwrite=True)  # --overwrite: taken (the rest of prepare imports torch: seconds)
    assert cli._parser().parse_args(["eval", "--ckpt", "A", "--overwrite"]).overwrite


@pytest.mark.parametrize("marker", ["run.lock", "metrics.jsonl", "checkpoints"])
def test_a_training_runs_directory_is_refused_even_with_overwrite(no_engine, capsys, hf_dir, prompts, tmp_path, marker):
    run = tmp_path / "run"
    (run / "engine_model").mkdir(parents=True)
    (run / "engine_model" / "config.json").write_text("{}")
    (run / marker).mkdir() if marker == "checkpoints" else (run / marker).write_text("{}")
    err = refused(capsys, "--ckpt", str(hf_dir), "--set", f"add={prompts}", "--out", str(run), "--overwrite")
    assert f"--out {run} is a training run's directory (it holds {marker}): eval would rewrite the run's " \
           f"engine_model/ there; give the report a directory of its own, e.g. --out {run / 'eval'}" in err, err
    assert (run / "engine_model" / "config.json").read_text() == "{}"

