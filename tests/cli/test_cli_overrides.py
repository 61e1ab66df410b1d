"""`key=value` overrides on both sides of an option (`train rl.steps=3 --output-dir D rl.recipe=gspo`)
are all overrides, in command-line order: argparse takes one run of positionals, and the ones after
the option were refused as "unrecognized arguments: rl.recipe=gspo". Anything else left over (an
unknown option, a word without '=') is still refused."""

from __future__ import annotations

import pytest

from megatron_rl import cli


@pytest.mark.parametrize("argv, overrides", [
    (["train", "rl.steps=3", "--output-dir", "D", "rl.recipe=gspo", "--verbose", "rl.steps=4"],
     ["rl.steps=3", "rl.recipe=gspo", "rl.steps=4"]),
    (["launch", "slurm", "--nodes", "2", "parallel.ep=2", "--dry-run", "parallel.etp=1"],
     ["parallel.ep=2", "parallel.etp=1"]),
    (["eval", "--ckpt", "runs/a", "set.x.n=2", "--set", "x=heldout", "set.x.k=1"], ["set.x.n=2", "set.x.k=1"]),
])
def test_overrides_after_an_option_are_overrides(argv, overrides):
    assert cli.parse_command_line(argv).overrides == overrides


def test_a_split_override_reaches_the_config_loader(capsys, tmp_path):
    assert cli.main(["train", "rl.steps=1", "--output-dir", str(tmp_path), "rl.stepz=2"]) == 2
    assert "unknown key 'rl.stepz'; did you mean 'steps'?" in capsys.readouterr().err


@pytest.mark.parametrize("stray", ["--steps", "stray"])
def test_anything_else_left_over_is_still_refused(capsys, stray):
    with pytest.raises(SystemExit) as exited:
        cli.parse_command_line(["train", "rl.steps=1", "--output-dir", "D", stray])
    assert exited.value.code == 2
    assert f"unrecognized arguments: {stray}" in capsys.readouterr().err
