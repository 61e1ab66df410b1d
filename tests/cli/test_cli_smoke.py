"""`megatron-rl smoke` writes its metrics into its own directory, never into the main job's."""

import sys
import types

import pytest

from _support.processes import REPO
from megatron_rl import cli

pytestmark = pytest.mark.subprocess  # runs a child process (pyproject's marks; scripts/test.sh --quick)


@pytest.fixture
def smoke_configs(monkeypatch):
    """The RunConfig each `smoke` command line hands to run_smoke (the run itself is not started)."""
    seen = []
    fake = types.ModuleType("megatron_rl.train.smoke")
    fake.run_smoke = lambda config, steps: seen.append(config)
    monkeypatch.setitem(sys.modules, "megatron_rl.train.smoke", fake)
    return seen


@pytest.mark.parametrize(
    "argv, output_dir",
    [
        (["--config", "configs/tiny_cpu.yaml", "--steps", "3"], "runs/smoke"),  # the recipe says runs/default
        ([], "runs/smoke"),
        (["--output-dir", "elsewhere"], "elsewhere"),
        (["output_dir=there"], "there"),
    ],
)
def test_smoke_output_dir(smoke_configs, monkeypatch, argv, output_dir):
    monkeypatch.chdir(REPO)  # the recipe path is relative to the repository
    assert cli.main(["smoke", "--verbose", *argv]) == 0
    assert smoke_configs[-1].output_dir == output_dir


def test_train_keeps_the_recipe_output_dir(monkeypatch):
    monkeypatch.chdir(REPO)
    args = cli._parser().parse_args(["train", "--config", "configs/tiny_cpu.yaml"])
    assert not any(item.startswith("output_dir=") for item in cli.command_overrides(args))
