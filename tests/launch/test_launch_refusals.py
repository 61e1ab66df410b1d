"""`megatron-rl launch` refuses, naming the option or key, what would fail only after the wait:
a local process count below one (was a ZeroDivisionError traceback from the layout check at 0,
and a torchrun command with --nproc-per-node=-2 at -2), and a prompt file that is not there (was
submitted: the job failed on its first node after waiting in the queue). In-process, nothing
submitted or started."""

from __future__ import annotations

import pytest

from megatron_rl import cli


@pytest.mark.parametrize("count", ["0", "-2"])
def test_launch_local_refuses_fewer_than_one_process(capsys, count):
    assert cli.main(["launch", "local", "--dry-run", "--nproc-per-node", count]) == 2
    err = capsys.readouterr().err
    assert f"--nproc-per-node must be >= 1 (trainer processes on this machine), got {count}" in err, err


@pytest.mark.parametrize("key", ["data.train", "data.heldout"])
@pytest.mark.parametrize("dry_run", [True, False])
def test_launch_slurm_names_a_missing_prompt_file_before_writing_or_submitting(tmp_path, capsys, monkeypatch,
                                                                                key, dry_run):
    monkeypatch.setenv("PATH", str(tmp_path / "no-sbatch"))  # were it submitted: sbatch not found, exit 1
    out, missing = tmp_path / "run", tmp_path / "prompts" / "math_train.parquet"
    argv = ["launch", "slurm", "--nodes", "1", "--output-dir", str(out), f"{key}={missing}"]
    assert cli.main(argv + (["--dry-run"] if dry_run else [])) == 2
    err = capsys.readouterr().err
    assert f"{key}: prompt file {missing} does not exist" in err, err
    assert not out.exists()
    missing.parent.mkdir()
    missing.touch()  # there now: the dry run renders the job
    assert cli.main(argv + ["--dry-run"]) == 0
    assert "#SBATCH --nodes=1" in capsys.readouterr().out


@pytest.mark.parametrize("options, message", [
    (["--gpus-per-node", "1", "--procs-per-node", "2"],
     "--procs-per-node 2 is more than --gpus-per-node 1: each trainer process needs a GPU of its own"),
    (["--container-mounts", "/data:/data"],
     "--container-mounts mounts into the --container-image, which is not given"),
])
def test_launch_slurm_refuses_options_the_job_could_not_honour(tmp_path, capsys, options, message):
    """Both rendered a job script: two ranks on one GPU (NCCL fails on the nodes, after the queue),
    mounts silently left out of the script."""
    assert cli.main(["launch", "slurm", "--nodes", "1", "--output-dir", str(tmp_path / "run"), "--dry-run",
                     *options]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("text, seconds", [("90", 5400), ("10:30", 630), ("04:00:00", 14400), ("1-00", 86400),
                                           ("2-12:30", 217800), ("1-12:00:00", 129600), ("UNLIMITED", None),
                                           ("0", None), ("00:00:00", None), ("0-0", None)])
def test_slurm_time_limits_in_every_form_sbatch_takes(text, seconds):
    """A limit of zero, in any form, is sbatch's "no time limit" (as UNLIMITED): it was refused as
    leaving no time before the preemption warning."""
    from megatron_rl.launch.slurm import time_limit_seconds

    assert time_limit_seconds(text) == seconds


@pytest.mark.parametrize("options, message", [
    (["--time", "4h"], "--time '4h' is not a SLURM time limit: give MINUTES, MM:SS, HH:MM:SS"),
    (["--time", "00:02:00"], "--time 00:02:00 (120 s) leaves no time before the preemption warning "
                             "--signal-lead-seconds 120"),
])
def test_launch_slurm_refuses_a_time_limit_before_writing(tmp_path, capsys, monkeypatch, options, message):
    """'4h' was written into the script for sbatch to refuse; a limit within the warning's lead made
    every start of the job checkpoint and requeue itself at once, without end."""
    monkeypatch.setenv("PATH", str(tmp_path / "no-sbatch"))
    out = tmp_path / "run"
    assert cli.main(["launch", "slurm", "--nodes", "1", "--output-dir", str(out), *options]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
