"""The planner's stage composition (one probe model per (tp, ep, etp), plan/meta_model.py) equals
whole pipeline stages built on the meta device, parameter by parameter in Megatron's order:
DeepSeek-V3 at its recipe's layout (uneven stages), GLM-4.5, a tied model at PP2 (the shared
embedding flags) and tiny DeepSeek-V3 at TP2 x EP2."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from _support.processes import child_env, python_command

pytestmark = pytest.mark.subprocess  # runs a child process (pyproject's marks; scripts/test.sh --quick)

HERE = Path(__file__).parent


def test_composed_stages_equal_whole_stages_built_on_meta(tmp_path):
    out = tmp_path / "compose.json"
    env = child_env(OMP_NUM_THREADS="2")
    result = subprocess.run(python_command(HERE / "plan_worker.py", "compose", out, preloaded=True), env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    cases = json.loads(out.read_text())
    assert len(cases) == 11
    for name, case in cases.items():
        assert case["built"] == case["composed"], name
        assert case["built_expert"] == case["composed_expert"], name
        assert case["built_shared"] == case["composed_shared"], name
    # DeepSeek-V3 at tp8 pp4 ep64: 4 routed experts per GPU per MoE layer, counted from the model
    assert sum(cases["deepseek-v3/stage1"]["built"]) == 3_310_485_504
    assert cases["tiny-qwen3/stage1"]["built_shared"] == 1
