"""A path given on the command line is the path: `--output-dir` was folded into an `output_dir=...`
override that the loader read as YAML, so `train --output-dir "/runs/victim #new-experiment"`
wrote into /runs/victim (a comment), `--output-dir 2024-01-01` was refused as a date, `yes` as a
boolean, and a newline became a space. Every subcommand's path options and every `key=value`
override of a key the config types as text now keep the text as written (tests/config/
test_config.py covers the loader itself); the job scripts and printed commands quote it."""

from __future__ import annotations

import shlex
import sys
import types

import pytest

from _support.processes import REPO
from megatron_rl import cli

PATHS = ["/runs/victim #new-experiment", "2024-01-01", "yes", "off", "null", "runs/a\nb", "runs/it's here"]


@pytest.fixture
def started(monkeypatch):
    """The RunConfig (train, smoke) or output argument (sft) each command line hands to the run,
    which is not started."""
    seen = []

    def module(name: str, **functions):
        import megatron_rl.train

        fake = types.ModuleType(name)
        fake.__dict__.update(functions)
        monkeypatch.setitem(sys.modules, name, fake)
        # `from megatron_rl.train import sft` reads the package's attribute when the module was imported before
        monkeypatch.setattr(megatron_rl.train, name.rsplit(".", 1)[1], fake, raising=False)

    module("megatron_rl.train.smoke", run_smoke=lambda config, steps: seen.append(config.output_dir))
    module("megatron_rl.train.trainer", train=lambda config: seen.append(config.output_dir) or types.SimpleNamespace(
        is_driver=False))
    module("megatron_rl.train.sft", run_sft=lambda config, output, force: seen.append(output) or types.SimpleNamespace(
        is_driver=False))
    monkeypatch.setattr("megatron_rl.train.preflight.check_layout_and_paths", lambda config: None)
    return seen


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("command", ["train", "smoke", "sft"])
def test_output_dir_is_taken_verbatim(started, monkeypatch, command, path):
    monkeypatch.chdir(REPO)
    assert cli.main([command, "--output-dir", path]) == 0
    assert started == [path]


@pytest.mark.parametrize("path", PATHS[:2])
def test_a_path_override_is_taken_verbatim_too(started, monkeypatch, path):
    monkeypatch.chdir(REPO)
    assert cli.main(["train", f"output_dir={path}"]) == 0
    assert started == [path]


def test_launch_local_passes_the_path_as_one_argument_and_prints_it_quoted(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    path = "/runs/victim #new-experiment"
    assert cli.main(["launch", "local", "--dry-run", "--output-dir", path]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert shlex.split(printed)[-1] == f"output_dir={path}", printed  # what a shell hands the ranks


def test_launch_slurm_quotes_the_run_directory_in_the_job_script(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    path = str(tmp_path / "victim #new-experiment")
    assert cli.main(["launch", "slurm", "--nodes", "1", "--dry-run", "--output-dir", path]) == 0
    script = capsys.readouterr().out
    assert f"RUN_DIR={shlex.quote(path)}\n" in script, script
    assert f"#SBATCH --output={shlex.quote(path)}/logs/slurm-%j.out\n" in script, script  # sbatch reads shell quotes
    assert cli.main(["launch", "slurm", "--nodes", "1", "--dry-run", "--output-dir", str(tmp_path / "a\nb")]) == 2
    assert "holds a line break, which the job script cannot hold in one line" in capsys.readouterr().err
