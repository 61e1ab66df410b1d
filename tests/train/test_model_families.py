"""A short RL run on DeepSeek-V3 (multi-latent attention, group-limited sigmoid routing with a
correction bias, a shared expert), end to end: warm start, rollout on the real vLLM CPU engine,
update, weight push, the next rollout. (`model.hf_config=tiny-glm4-moe` passed the same checks
while it was a case here, and failed at 0.19 with the bias left out of the push.)

The router's expert bias moves every step (model.moe_router_bias_update_rate), so the engine
serves the trainer's logprobs only if the push carries the bias as well as the parameters. The
DeepSeek-V3 preset, like a config transformers writes, lacks `topk_method` / `scoring_func`,
which vLLM needs to route with the bias: the trainer's engine directory must add them.

The run trains LoRA adapters (model.lora, every default target): on multi-latent attention's
four projections, the dense layer's MLP, the shared expert and every routed expert, trained by
the warm start too, so every push carries W + (alpha / rank) B A. The full model's push on this
family, bias included, is tests/rollout/test_vllm_families.py (one process) and
tests/rollout/test_vllm_sync.py (TP2).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from _support.processes import child_env, cli_command

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[rollout-cpu])")

from run_records import metrics  # noqa: E402

pytestmark = pytest.mark.engine

RUN = ["rl.steps=3", "rl.prompts_per_step=8", "rl.group_size=4", "rl.max_response_tokens=6",
       "warm_start.steps=80", "data.synthetic.max_operand=3", "data.num_heldout=2", "rl.eval_every=0", "checkpoint.every_steps=0",
       "logging.wandb_mode=disabled", "model.moe_router_bias_update_rate=0.05", "optimizer.lr=3e-3",
       "model.lora.rank=8", "model.lora.alpha=16"]


# GLM-4.5 runs the same push code; its engine parity after pushes of new weights (the correction
# bias included) is tests/rollout/test_vllm_families.py. One run here keeps the suite's time.
@pytest.mark.parametrize("preset", ["tiny-deepseek-v3"])
def test_rl_steps_with_engine_parity(tmp_path, preset):
    out = tmp_path / preset
    command = cli_command("train", "--output-dir", str(out), f"model.hf_config={preset}", *RUN, preloaded=True)
    result = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    steps = {step: record for step, record in metrics(out).items() if step >= 1}  # step 0: the eval before RL
    assert sorted(steps) == [1, 2, 3]
    for step, record in steps.items():
        # Steps 2 and 3 generate with weights pushed after an update (and a moved expert bias).
        assert record["mismatch/logp_abs_diff_max"] <= 1e-4, (step, record["mismatch/logp_abs_diff_max"])
        assert record["count/sequences"] > 0  # groups with mixed rewards were trained on
    assert any(record["train/grad_norm"] > 0 for record in steps.values())
    engine_config = json.loads((out / "engine_model" / "config.json").read_text())
    if preset == "tiny-deepseek-v3":
        assert (engine_config["topk_method"], engine_config["scoring_func"]) == ("noaux_tc", "sigmoid")
