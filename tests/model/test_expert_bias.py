"""Aux-loss-free load balancing (model.moe_router_bias_update_rate) on a DeepSeek-V3-style model.

The router's expert bias (HF e_score_correction_bias) is a buffer the optimizer never sees:
after each step Megatron-Core moves it by `rate * sign(mean load - expert load)`. Checked against
that rule re-derived from the routes the training forward used (routing replay forces them, so
the counts are known exactly), on one process and at EP2 (the counts are summed over ranks).
The updated bias is what the bridge exports and checkpoints restore; the KL reference keeps the
starting bias.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from _support.processes import child_env, torchrun_command

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("expert_bias_worker.py")
RATE = 0.01


def run(tmp_path: Path, nproc: int, overrides: list[str]) -> list[dict]:
    out = tmp_path / "result"
    command = torchrun_command(WORKER, nproc, "tiny-deepseek-v3", str(out), preloaded=True)
    for item in overrides:
        command += ["--override", item]
    env = child_env()
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    return [json.loads((tmp_path / f"result.rank{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.parametrize("nproc, layout", [(1, []), (2, ["parallel.ep=2", "parallel.etp=1"])], ids=["one_process", "ep2"])
def test_bias_moves_toward_balance_and_travels_with_the_model(tmp_path, nproc, layout):
    results = run(tmp_path, nproc, [f"model.moe_router_bias_update_rate={RATE}", *layout])
    first = results[0]
    assert first["rate"] == RATE
    assert first["drift"] == 0.0  # the training forward used exactly the recorded routes
    for layer, name in enumerate(first["names"]):
        before = torch.tensor(first["before"][name])
        counts = torch.tensor(first["counts"][layer])
        expected = before + RATE * torch.sign(counts.mean() - counts)
        for result in results:  # every rank holds the same updated bias
            assert torch.equal(torch.tensor(result["after"][name]), expected), (name, result["after"][name], expected)
        assert counts.sum() > 0 and not torch.equal(expected, before)
    hf_names = sorted(first["exported"])
    assert len(hf_names) == len(first["names"])
    for hf_name, name in zip(hf_names, first["names"]):
        assert torch.equal(torch.tensor(first["exported"][hf_name]), torch.tensor(first["after"][name]))
    for result in results:
        assert result["reference_equal_before"] and result["live_restored_after_reference"]
        assert result["checkpoint_restores"] and result["checkpoint_reference_equal_before"]


def test_default_rate_keeps_the_checkpoint_bias(tmp_path):
    result = run(tmp_path, 1, [])[0]
    assert result["rate"] == 0.0
    assert result["after"] == result["before"]
