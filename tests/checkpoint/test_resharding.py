"""Resume at another layout: model, Adam's moments, LR schedule and KL reference weights (with
model.lora: the adapters and their moments, the base frozen).

A checkpoint written at one layout is resumed at the same layout (the baseline) and at another;
the two updates after the resume must agree within 1e-5 relative (loss and grad norm). The
second update's loss depends on the restored moments: with the moments zeroed after loading (the
control) it differs, so the comparison would notice optimizer state that did not come back.
Real multi-process gloo jobs, Megatron-Core torch_dist files on disk.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _support.rank_pool import RankPools

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("reshard_worker.py")
REL_TOL = 1e-5

LORA = ["model.lora.rank=4", "model.lora.alpha=8"]
LAYOUTS = {
    "single": (1, []),
    "ep2": (2, ["parallel.ep=2", "parallel.etp=1"]),
    "tp2": (2, ["parallel.tp=2", "parallel.etp=2"]),
    "dp2_distopt": (2, ["parallel.distributed_optimizer=true"]),
    # The tiny dense preset ties its embeddings: at PP2 the last stage holds a second copy of the
    # shared matrix, which a checkpoint stores once and a one-stage layout does not have at all.
    "tied_single": (1, ["model.hf_config=tiny-qwen3"]),
    "tied_pp2": (2, ["model.hf_config=tiny-qwen3", "parallel.pp=2"]),
    # LoRA (model/lora.py): the adapters and their moments are the whole trainable state. At TP2 x
    # ETP2 every adapter is split (column-parallel B on its outputs, row-parallel A on its inputs,
    # the experts' over expert-TP); one process holds them whole.
    "lora_tp2": (2, ["parallel.tp=2", "parallel.etp=2", *LORA]),
    "lora_single": (1, LORA),
}


def run(mode: str, layout: str, root: Path, ckpt: Path, out: Path, *extra: str, weights: str = "weights",
        ranks: RankPools) -> dict:
    nproc, overrides = LAYOUTS[layout]
    out.mkdir(parents=True, exist_ok=True)
    args = [mode, "--ckpt", str(ckpt), "--weights", str(root / weights), "--out", str(out), *extra]
    for item in overrides:
        args += ["--override", item]
    result = ranks.run(WORKER, nproc, *args)
    assert result.returncode == 0, f"{mode} at {layout} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return json.loads((out / f"{mode}.json").read_text())


def same_updates(result: dict) -> dict:
    """What an exact resume reproduces: every update's loss, grad norm and learning rate."""
    return {key: result[key] for key in ("loss", "grad_norm", "lr")}


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def assert_same_updates(got: dict, baseline: dict) -> None:
    for key in ("loss", "grad_norm"):
        for a, b in zip(got[key], baseline[key]):
            assert relative(a, b) <= REL_TOL, (key, got, baseline)
    assert got["lr"] == pytest.approx(baseline["lr"], rel=1e-12)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("reshard")


MOVES = [("ep2", "single"), ("single", "ep2"), ("tp2", "dp2_distopt"), ("tied_pp2", "tied_single"),
         ("tied_single", "tied_pp2"), ("lora_tp2", "lora_single")]


def starting_weights(layout: str) -> str:
    """The shared starting weights of the layout's model (the tied dense model, the MoE with
    adapters, the plain MoE): one file set per model, written by its first save."""
    family = layout.split("_")[0]
    return f"weights_{family}" if family in ("tied", "lora") else "weights"


@pytest.mark.parametrize("saved_at,resumed_at", MOVES)
def test_resume_at_another_layout_matches_same_layout_resume(root, rank_pools, saved_at, resumed_at):
    ckpt = root / f"ckpt_{saved_at}"
    weights = starting_weights(saved_at)
    saved = run("save", saved_at, root, ckpt, root / f"save_{saved_at}", weights=weights, ranks=rank_pools)
    assert saved["grad_norm"][1] > 0  # the saved state has non-zero moments
    baseline = run("resume", saved_at, root, ckpt, root / f"{saved_at}_to_{saved_at}", weights=weights,
                   ranks=rank_pools)
    # A same-layout resume continues the run exactly.
    assert same_updates(baseline) == same_updates(saved["continued"])
    moved = run("resume", resumed_at, root, ckpt, root / f"{saved_at}_to_{resumed_at}", weights=weights,
                ranks=rank_pools)
    assert moved["layout"]["world"] == LAYOUTS[resumed_at][0]
    # The LR schedule continued (warmup of 3 steps: step 3 is past it, not restarted at step 1).
    assert baseline["lr"][0] == pytest.approx(0.003, rel=1e-6)
    assert_same_updates(moved, baseline)

    # The KL reference weights came back at the new layout, equal to the weights saved at start.
    initial = torch.load(root / f"{saved_at}_to_{resumed_at}" / "reference.pt")
    same_layout = torch.load(root / f"{saved_at}_to_{saved_at}" / "reference.pt")
    assert sorted(initial) == sorted(same_layout) and initial
    for key in initial:
        assert torch.equal(initial[key], same_layout[key]), key


def test_bf16_resume_at_another_layout_restores_the_fp32_main_weights(root, rank_pools):
    """bf16: the optimizer's fp32 main weights are saved too (the bf16 weights alone would round
    them). Across layouts the order of bf16 reductions changes, so the bound there is the parity
    suite's bf16 loss bound, not 1e-5."""
    ckpt = root / "ckpt_ep2_bf16"
    bf16 = ["--override", "model.precision=bf16"]
    saved = run("save", "ep2", root, ckpt, root / "save_ep2_bf16", *bf16, weights="weights_bf16", ranks=rank_pools)
    baseline = run("resume", "ep2", root, ckpt, root / "ep2_to_ep2_bf16", *bf16, weights="weights_bf16",
                   ranks=rank_pools)
    # Exact at the same layout: with only the bf16 weights restored (main weights rounded), not.
    assert same_updates(baseline) == same_updates(saved["continued"])
    moved = run("resume", "single", root, ckpt, root / "ep2_to_single_bf16", *bf16, weights="weights_bf16",
                ranks=rank_pools)
    for a, b in zip(moved["loss"], baseline["loss"]):
        assert abs(a - b) <= 2e-3, (moved, baseline)
    assert moved["lr"] == pytest.approx(baseline["lr"], rel=1e-12)


def test_control_zeroed_moments_change_the_second_update(root, rank_pools):
    """Without the restored moments the second update differs: the test above can fail."""
    ckpt = root / "ckpt_ep2"
    if not (ckpt / "small.json").is_file():
        run("save", "ep2", root, ckpt, root / "save_ep2", ranks=rank_pools)
    # The same resume as the (ep2 -> single) move above: its result, where that test ran first.
    moved = root / "ep2_to_single" / "resume.json"
    baseline = json.loads(moved.read_text()) if moved.is_file() else \
        run("resume", "single", root, ckpt, root / "ep2_to_single", ranks=rank_pools)
    dropped = run("resume", "single", root, ckpt, root / "ep2_to_single_dropped", "--drop-moments",
                  ranks=rank_pools)
    assert relative(dropped["loss"][0], baseline["loss"][0]) <= REL_TOL  # same weights before any update
    assert relative(dropped["loss"][1], baseline["loss"][1]) > 100 * REL_TOL


def test_changed_optimizer_settings_take_effect_on_resume(root, rank_pools):
    """checkpoint.allow_config_change: a resume with another learning rate and weight decay
    trains with both. The schedule's position comes from the checkpoint, its settings from the
    config; Megatron's default kept the saved weight decay (the saved lr lost to the param
    groups' own max_lr), so a changed weight decay silently did nothing."""
    ckpt = root / "ckpt_single"
    if not (ckpt / "small.json").is_file():
        run("save", "single", root, ckpt, root / "save_single", ranks=rank_pools)
    # Saved with optimizer.lr=0.003 and optimizer.weight_decay=0.01 (reshard_worker.OVERRIDES).
    changed = run("resume", "single", root, ckpt, root / "single_changed_settings", "--override",
                  "optimizer.weight_decay=0.05", "--override", "optimizer.lr=0.002", ranks=rank_pools)
    assert changed["weight_decay"] == [0.0, 0.05] and changed["one_lr"]
    # Step 3 ends the 3-step warm-up: the full rate, the new one; the schedule did not restart.
    assert changed["lr"][0] == pytest.approx(0.002, rel=1e-12)
