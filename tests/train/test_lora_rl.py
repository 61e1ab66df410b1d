"""RL with LoRA (`model.lora`) end to end through `megatron-rl train`: the Megatron-Core policy
trains its adapters, the real vLLM CPU engine generates from the merged weights W + (alpha/rank) B A.

- colocated: after every weight push (steps 2 and on: B moved at step 1) the trainer's logprob
  equals the engine's on every scored token within 1e-4 (`mismatch/logp_abs_diff_max`, the max
  over all of them); the checkpoint holds the adapters (B nonzero) and the optimizer state of the
  adapters only;
- the same run stopped by SIGTERM after a step and resumed with the same command logs the
  uninterrupted run's metrics (loss, grad norm, rewards, everything but wall-clock times) bit for
  bit for the steps after its checkpoint, and ends with the same adapters and optimizer state: the
  resumed run continued from the saved adapters, not from new ones;
- server mode (tests/train/test_lora_server.py): the same parity on the shared vLLM server, with
  the merged weights pushed as files;
- the adapter-only push (rollout.lora_push=adapters, attention targets: vLLM's native LoRA): the
  same parity after every push, the base pushed once and then the adapters alone, and the bytes
  per push against the merged run's, both exactly what the tensors' sizes say.

A random base model with frozen embeddings learns the synthetic task slowly through rank-8
adapters, so its groups would mostly score 0 and train on nothing; the format reward below
("the response holds a digit") gives most groups mixed rewards, so every step updates the
adapters and every push carries new merged weights. The task is not learning here but the
engine serving what the trainer trains.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[rollout-cpu])")

from _support.processes import child_env, cli_command  # noqa: E402
from run_records import comparable, metrics  # noqa: E402
from test_train_loop import SHORT, run, stop_with_sigterm  # noqa: E402

pytestmark = pytest.mark.engine

STEPS = 6  # room for a late SIGTERM (test_train_loop.stop_with_sigterm): the stop comes well before
# Overrides on top of test_train_loop's SHORT. No warm start: B = 0 at the first push, nonzero
# from the second (step 1 trains it). optimizer.lr 2e-3 (adapters take a larger rate, docs/lora.md)
# makes W + s B A after one step far enough from W that an unmerged push fails the 1e-4 check.
# dr_grpo: no dynamic sampling, so every step scores every sample whatever the rewards. One
# update per rollout: train/grad_norm is the last update's, here the step's. Groups of 8 at a
# reward rate near 0.15: most steps have a group with mixed rewards (a step without one leaves B
# where it was; another CPU's kernels sample other tokens, so which steps those are is not fixed).
LORA_RUN = ["model.lora.rank=8", "model.lora.alpha=16", "optimizer.lr=2e-3", f"rl.steps={STEPS}", "rl.recipe=dr_grpo",
            "rl.updates_per_rollout=1", "rl.prompts_per_step=4", "rl.group_size=8", "warm_start.steps=0",
            "data.num_heldout=2",
            "rl.eval_every=0", "checkpoint.every_steps=2", "checkpoint.export_hf=false",
            "rewards.terms=[{name: format, params: {pattern: '.*[0-9].*'}}]"]


def checkpoint_tensors(checkpoint: Path, weights: str = "weights") -> dict:
    """Every tensor of a checkpoint's torch_dist weights (model and optimizer), read in this process
    (`weights`: their folder in the checkpoint; "." for a converted one, e.g. a LoRA run's base)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(checkpoint / weights))
    tensors = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
               for key, meta in reader.read_metadata().state_dict_metadata.items()
               if isinstance(meta, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


def adapter_keys(tensors: dict, prefix: str = "decoder.") -> list[str]:
    """The adapters' keys (the model's by default; prefix "optimizer.exp_avg." their moments)."""
    return sorted(k for k in tensors if k.startswith(prefix) and k.endswith((".lora_A", ".lora_B")))


def assert_engine_matches_trainer(steps: dict[int, dict], last: int = STEPS) -> None:
    """Every RL step scored tokens, and the engine's logprob of each is the trainer's within 1e-4."""
    assert sorted(step for step in steps if step >= 1) == list(range(1, last + 1))
    for step in range(1, last + 1):
        record = steps[step]
        assert record["count/tokens"] > 0, (step, record)
        assert record["mismatch/logp_abs_diff_max"] <= 1e-4, (step, record["mismatch/logp_abs_diff_max"])
    # The adapters moved before a push the check above covers (B = 0 at the first push): the
    # engine was served W + s B A with B != 0, not W. Steps without a mixed-reward group move
    # nothing; at least one before the last must have moved them.
    moved = [step for step in range(1, last) if steps[step]["train/grad_norm"] > 0]
    assert moved, {step: steps[step]["train/grad_norm"] for step in range(1, last + 1)}


@pytest.fixture(scope="module")
def merged_run(tmp_path_factory) -> Path:
    """The LoRA run with the default merged push (every default target), shared by the tests below."""
    whole = tmp_path_factory.mktemp("lora") / "whole"
    run(whole, *LORA_RUN)
    return whole


def test_lora_engine_matches_trainer_and_resumes_exactly_after_sigterm(merged_run, tmp_path):
    whole = merged_run
    reference = metrics(whole)
    assert_engine_matches_trainer(reference)

    saved = checkpoint_tensors(whole / "checkpoints" / f"step_{STEPS:06d}")
    adapters = adapter_keys(saved)
    assert len(adapters) == 16  # qkv, proj, experts' fc1 and fc2 (A and B) in each of the 2 layers
    # The frozen base is not in the checkpoint (checkpoint.base_weights=referenced, the default):
    # written once at the start into checkpoints/base/, which every checkpoint names.
    assert {k for k in saved if k.startswith(("decoder.", "embedding.", "output_layer."))} == set(adapters)
    metadata = json.loads((whole / "checkpoints" / f"step_{STEPS:06d}" / "megatron_rl.json").read_text())
    assert metadata["base"]["path"] == "../base" and "__0_0.distcp" in metadata["base"]["files"]
    # B moved from 0: the engines served W + s B A, not W (so the check above can fail)
    assert all(saved[k].abs().max() > 1e-3 for k in adapters if k.endswith("lora_B"))
    # the optimizer state is the adapters' and nothing else's (the base is frozen)
    for state in ("exp_avg", "exp_avg_sq"):
        assert adapter_keys(saved, f"optimizer.{state}.") == [f"optimizer.{state}.{k}" for k in adapters]
        assert {k for k in saved if k.startswith(f"optimizer.{state}.")} == set(adapter_keys(saved, f"optimizer.{state}."))

    interrupted = tmp_path / "interrupted"
    output = stop_with_sigterm(interrupted, *LORA_RUN, after_step=1)
    stopped_at = json.loads((interrupted / "run_state.json").read_text())["step"]
    assert 1 <= stopped_at < STEPS, output[-2000:]
    assert f"stopped by SIGTERM after step {stopped_at}" in output
    stopped = checkpoint_tensors(interrupted / "checkpoints" / f"step_{stopped_at:06d}")
    assert adapter_keys(stopped) == adapters and all(stopped[k].abs().max() > 0 for k in adapters)

    resumed = run(interrupted, *LORA_RUN)
    assert "resumed from" in resumed.stdout
    after = metrics(interrupted)
    assert_engine_matches_trainer(after)  # the resumed run's first push: the saved adapters merged
    for step in range(stopped_at + 1, STEPS + 1):
        assert comparable(after[step]) == comparable(reference[step]), f"step {step} differs after resume"
    # Same adapters and optimizer moments at the end as the uninterrupted run, bit for bit.
    ended = checkpoint_tensors(interrupted / "checkpoints" / f"step_{STEPS:06d}")
    for key in adapters + adapter_keys(saved, "optimizer."):
        assert ended[key].equal(saved[key]), key


def test_a_resume_whose_base_changed_is_refused_by_name(merged_run, tmp_path):
    """The base a LoRA run's checkpoints name is checked before anything starts: one byte more in
    a base file is refused by the preflight (checked here in process: the load would refuse it
    too, with the same message, after the ranks have started), and the command exits naming the
    checkpoint and the file (a change of the same size is refused by its CRC-32 when the base is
    loaded: tests/model/test_lora.py)."""
    from megatron_rl.checkpoint.manager import check_run_directory
    from megatron_rl.config import load_config
    from megatron_rl.errors import ConfigError

    out = tmp_path / "run"
    shutil.copytree(merged_run, out)
    with open(out / "checkpoints" / "base" / "__0_0.distcp", "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(ConfigError, match="has changed: __0_0.distcp has"):
        check_run_directory(load_config(None, [*SHORT, *LORA_RUN, f"output_dir={out}"]))
    result = subprocess.run(cli_command("train", "--output-dir", str(out), *SHORT, *LORA_RUN, preloaded=True),
                            env=child_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "has changed: __0_0.distcp has" in result.stderr and f"step_{STEPS:06d}" in result.stderr, \
        result.stderr[-3000:]


ADAPTER_STEPS = 4
ADAPTER_RUN = [*LORA_RUN, f"rl.steps={ADAPTER_STEPS}", "checkpoint.every_steps=0", "model.lora.targets=[qkv,proj]",
               "rollout.lora_push=adapters"]


def pushed_bytes(base: dict, tensors: dict) -> tuple[int, int]:
    """(merged push, adapter push) in bytes (fp32 engine), from the run's base (the checkpoints
    refer to it) and a checkpoint's tensors: the merged push is every base weight; the adapter push
    is PEFT's tensors, A once per HF projection (q, k and v each get linear_qkv's A and their rows
    of B) and B whole."""
    assert base and not adapter_keys(base)
    base = sum(t.numel() for t in base.values())
    adapters = 0
    for key in adapter_keys(tensors):
        pieces = 3 if ".linear_qkv." in key and key.endswith(".lora_A") else 1
        adapters += pieces * tensors[key].numel()
    return 4 * base, 4 * adapters


def test_adapter_push_engine_matches_trainer_and_sends_only_the_adapters(merged_run, tmp_path):
    out = tmp_path / "adapters"
    run(out, *ADAPTER_RUN)
    steps = metrics(out)
    assert_engine_matches_trainer(steps, last=ADAPTER_STEPS)  # vLLM's LoRA serves W + s B A
    saved = checkpoint_tensors(out / "checkpoints" / f"step_{ADAPTER_STEPS:06d}")
    assert all(saved[k].abs().max() > 1e-3 for k in adapter_keys(saved) if k.endswith("lora_B"))

    merged_bytes, adapter_bytes = pushed_bytes(checkpoint_tensors(out / "checkpoints" / "base", "."), saved)
    # the first push: the base once (adapters left out) and the adapters; every later one: the adapters
    assert steps[0]["rollout/weights_bytes"] == merged_bytes + adapter_bytes
    assert [steps[s]["rollout/weights_bytes"] for s in range(1, ADAPTER_STEPS + 1)] == [adapter_bytes] * ADAPTER_STEPS
    # the merged run sends the whole model every time (its base is the same model's)
    merged = metrics(merged_run)
    assert {merged[s]["rollout/weights_bytes"] for s in range(0, STEPS + 1)} == {merged_bytes}
    assert merged[1]["rollout/weights_bytes"] / steps[1]["rollout/weights_bytes"] == merged_bytes / adapter_bytes
