"""The code task end to end with the real parts: `megatron-rl train --config configs/tiny_code.yaml`
(Megatron-Core policy, vLLM CPU rollouts, the `code_tests` reward running every expression in
the sandbox through the recipe's harness), short.

The rewards must come from running the model's expressions, so the run scores every sample with
two more terms of weight 0 beside the recipe's: the task's own verifier (`synthetic:expr`, which
compares functions by walking the expression's syntax tree, no execution) and the same
`code_tests` reward behind a harness that exits before the model's code. The sandboxed reward
must agree with the verifier and be non-zero, and the control must be zero: a reward that did
not run the code (or ran something else) cannot do all three.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from _support.processes import REPO, child_env, cli_command

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[rollout-cpu])")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_records import metrics  # noqa: E402

pytestmark = pytest.mark.engine

# dr_grpo: no dynamic sampling, so each step scores exactly 8 prompts x 4 samples. 150 warm-start
# steps (~30 s) on the general expressions only bring the held-out pass rate to about 0.2: some
# samples pass, some fail (the recipe's lookup demonstrations would need a longer warm start).
SHORT = ["rl.recipe=dr_grpo", "rl.steps=2", "rl.prompts_per_step=8", "rl.group_size=4", "rl.eval_every=2",
         "warm_start.steps=150", "data.synthetic.general_demonstrations=1.0", "data.num_heldout=32",
         "checkpoint.every_steps=0", "checkpoint.export_hf=false", "logging.wandb_mode=disabled"]


def recipe_with_controls(path: Path) -> Path:
    recipe = yaml.safe_load((REPO / "configs/tiny_code.yaml").read_text())
    recipe["rewards"]["terms"] += [
        {"name": "synthetic:expr", "weight": 0.0},
        {"name": "code_tests", "label": "code_skipped", "weight": 0.0,  # a group's repeated answers: one call
         "params": {"harness": "raise SystemExit(0)\n{code}", "mode": "all", "cache_entries": 4096}},
    ]
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_code_task_rewards_come_from_running_the_expressions(tmp_path):
    config = recipe_with_controls(tmp_path / "tiny_code.yaml")
    command = cli_command("train", "--config", str(config), "--output-dir", str(tmp_path / "run"), *SHORT, preloaded=True)
    result = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    steps = metrics(tmp_path / "run")
    assert 0 < steps[0]["eval/accuracy"] < 1 and steps[0]["eval/prompts"] == 32, steps[0]
    sandboxed = verified = 0.0
    for step in (1, 2):
        record = steps[step]
        # 32 samples, each scored by the 3 terms
        assert record["count/sequences"] == 32 and record["reward/calls"] == 3 * 32, record
        assert record["reward/errors"] == 0, record
        for term in ("code_tests", "synthetic:expr", "code_skipped"):
            assert record[f"reward/{term}/errors"] == 0 and record[f"reward/{term}/timeouts"] == 0, (term, record)
        assert record["reward/code_skipped/mean"] == 0.0
        # 4 hidden tests vs every input in [0, 99]: the same verdict for the forms a model writes
        assert abs(record["reward/code_tests/mean"] - record["reward/synthetic:expr/mean"]) <= 1 / 32, record
        assert record["reward/mean"] == record["reward/code_tests/mean"]  # the controls weigh 0
        sandboxed += record["reward/code_tests/mean"]
        verified += record["reward/synthetic:expr/mean"]
    assert sandboxed > 0 and verified > 0
    assert "eval/accuracy" in steps[2]
