"""RL with LoRA on a vLLM server (rollout.mode=server, synchronous): the trainer pushes the merged
weights W + (alpha/rank) B A as files to the shared tiny server (tests/conftest.py) and, after
every push, the server's logprob of every scored token is the trainer's within 1e-4. The run's
first push overwrites the server's weights, under the names the trainer's export always uses
(LoRA adds none: the adapters are merged before the export's names are made). The colocated
case, the resume and why this run's reward is a format check: tests/train/test_lora_rl.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[rollout-cpu])")

from run_records import metrics  # noqa: E402
from test_lora_rl import LORA_RUN, STEPS, assert_engine_matches_trainer, checkpoint_tensors  # noqa: E402
from test_train_loop import run  # noqa: E402

pytestmark = pytest.mark.engine


def test_lora_server_matches_trainer_after_every_push(tiny_vllm_server, tmp_path):
    out = tmp_path / "server"
    run(out, *LORA_RUN, "rollout.mode=server", f"rollout.server_urls=[{tiny_vllm_server[0]}]",
        "rollout.weight_transport=files", f"rollout.staging_dir={tmp_path / 'staging'}")
    assert_engine_matches_trainer(metrics(out))
    # the pushes after step 1 carried adapters that had moved: W + s B A, not W
    saved = checkpoint_tensors(out / "checkpoints" / f"step_{STEPS:06d}")
    assert all(saved[k].abs().max() > 1e-3 for k in saved if k.startswith("decoder.") and k.endswith(".lora_B"))
