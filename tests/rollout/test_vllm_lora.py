"""vLLM's native LoRA as the adapter-only push (rollout.lora_push=adapters) uses it, in a real
engine (the CPU build), against transformers, for the dense families it is verified on
(lora_worker.py says what each run does): Qwen3 with every dense target (attention and MLP),
Llama with attention only, so that an MLP adapter lies outside its engine's targets.

- after each of two adapter pushes (in memory, a fresh id each) the engine's logprobs (prompt and
  sampled tokens, one prompt longer than a KV block) equal transformers' logprobs of the merged
  model W + (alpha / rank) B A within 1e-4 and differ from the previous adapter's;
- the trainer's tensors are not changed by the push (vLLM scales B in place);
- an adapter on a module outside the engine's targets is refused by name, by the engine before
  the workers and by the workers themselves, and the adapter served before stays served.

The Qwen3-MoE case (attention adapters beside the CPU MoE kernel) runs through the trainer in
tests/train/test_lora_rl.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from _support.processes import child_env, python_command

pytestmark = pytest.mark.engine

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[rollout-cpu])")

WORKER = Path(__file__).with_name("lora_worker.py")
TOL = 1e-4
CASES = {"qwen3": "qkv,proj,fc1,fc2", "llama": "qkv,proj"}


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, dict]:
    out = {}
    for family, targets in CASES.items():
        root = tmp_path_factory.mktemp(f"lora-{family}")
        result = subprocess.run(python_command(WORKER, "--family", family, "--targets", targets, "--root", root,
                                               "--out", root / "report.json", preloaded=True),
                                env=child_env(OMP_NUM_THREADS="2"), capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise AssertionError(f"lora worker failed ({family}):\n{result.stderr[-6000:]}")
        out[family] = json.loads((root / "report.json").read_text())
    return out


@pytest.mark.parametrize("family", sorted(CASES))
def test_each_adapter_push_serves_the_merged_model(reports, family):
    report = reports[family]
    for push in (1, 2):
        assert report[f"push{push}_tensors"] > 0, report
        assert report[f"push{push}_vs_merged"] <= TOL, report
        assert report[f"push{push}_vs_previous"] > 1e-2, report  # the adapter changes the model


@pytest.mark.parametrize("family", sorted(CASES))
def test_the_pushed_tensors_are_not_changed(reports, family):
    report = reports[family]
    assert report["push1_caller_tensors_unchanged"] and report["push2_caller_tensors_unchanged"], report


def test_an_adapter_outside_the_engine_targets_is_refused(reports):
    report = reports["llama"]  # attention only: an MLP adapter lies outside its targets
    assert f"adapters on ['{report['outside_module']}'] are outside the engine's LoRA targets" in report[
        "refused_by_engine"], report
    assert "holds modules the engine does not adapt" in report["refused_by_workers"], report
    assert report["after_refusals_vs_merged"] <= TOL, report
