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
