"""The fixtures of the `megatron-rl eval` refusal modules (test_command_refusals.py,
test_command_untrusted.py): the engine stage that fails a case reaching it, a prompt file, a
stand-in Hugging Face directory (stand_ins.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.evaluation import command
from stand_ins import stand_in_hf


@pytest.fixture
def no_engine(monkeypatch):
    """The engine stage (runtime, policy, rollout engine) fails the test if any case reaches it."""
    def reached(plan):
        raise AssertionError("the engine stage was reached: the bad input was not refused before it")

    monkeypatch.setattr(command, "evaluate", reached)


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "add.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+2=", "answer": str(a + 2), "task": "add"}) + "\n"
                            for a in range(3)))
    return path


@pytest.fixture
def hf_dir(tmp_path) -> Path:
    return stand_in_hf(tmp_path)
