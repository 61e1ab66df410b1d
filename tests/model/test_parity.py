"""Parallel layouts against a single-process run with the same weights (real gloo, real torchrun).

For each layout: per-token logprobs, the gradient of one step, and the loss over 3 optimizer
steps must equal the single-process reference within 1e-5 in fp32. A bf16 layout is held to a
looser, documented bound (bf16 has 8 mantissa bits; TP/EP change the order of bf16 reductions).

Each layout is a real multi-process job: `python -m torch.distributed.run` with gloo, Megatron's
own torch_dist checkpoints for the weights and for gathering gradients (see parity_worker.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _support.rank_pool import RankPools

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("parity_worker.py")

FP32_TOL = 1e-5
# bf16 (TP2 x EP2 x ETP2 vs one process, both bf16, same weights), measured on the tiny MoE:
# logprobs 2.5e-3, relative gradient error 3.3e-2 (worst tensor), loss over 3 steps 1.5e-4.
# TP/EP change the order of bf16 reductions, so exact equality is not expected. The bounds
# leave 3-13x headroom and still catch a wrong layout: an unreduced or misplaced shard gives
# errors of order 1 here.
BF16_LOGPROB_TOL = 0.02
BF16_GRAD_REL_TOL = 0.1
BF16_LOSS_TOL = 2e-3

# name: (processes, overrides, the layout Megatron must report). distributed_optimizer: whether
# the optimizer built is Megatron's DistributedOptimizer (parallel.distributed_optimizer, on by default).
LAYOUTS = {
    "tp2": (2, ["parallel.tp=2", "parallel.etp=2"], dict(tp=2, pp=1, ep=1, etp=2, dp=1, distributed_optimizer=True)),
    "ep2": (2, ["parallel.ep=2", "parallel.etp=1"], dict(tp=1, pp=1, ep=2, etp=1, dp=2, distributed_optimizer=True)),
    "pp2": (2, ["parallel.pp=2"], dict(tp=1, pp=2, ep=1, etp=1, dp=1, distributed_optimizer=True)),
    "tp2_ep2_etp2": (4, ["parallel.tp=2", "parallel.ep=2", "parallel.etp=2"],
                     dict(tp=2, pp=1, ep=2, etp=2, dp=2, distributed_optimizer=True)),
    "dp2_distopt": (2, ["parallel.distributed_optimizer=true"], dict(tp=1, pp=1, ep=1, etp=1, dp=2, distributed_optimizer=True)),
    "dp2_ddp": (2, ["parallel.distributed_optimizer=false"], dict(tp=1, pp=1, ep=1, etp=1, dp=2, distributed_optimizer=False)),
}


def run_worker(ranks: RankPools, out: Path, weights: Path, nproc: int, overrides: list[str], reference: bool = False,
               recipe: str | None = None, nonzero_adapters: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    args = ["--out", str(out), "--weights", str(weights)]
    for item in overrides:
        args += ["--override", item]
    if reference:
        args.append("--reference")
    if nonzero_adapters:
        args.append("--nonzero-adapters")
    if recipe:
        args += ["--recipe", recipe]
    result = ranks.run(WORKER, nproc, *args)
    if result.returncode != 0:
        raise AssertionError(f"worker failed ({' '.join(overrides)}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")


def read_logprobs(directory: Path) -> dict[int, dict[str, torch.Tensor]]:
    merged: dict[int, dict[str, torch.Tensor]] = {}
    for path in sorted(directory.glob("logprobs_rank*.pt")):
        merged.update(torch.load(path))
    return merged


def read_grads(directory: Path) -> dict[str, torch.Tensor]:
    return torch.load(directory / "grads.pt")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, rank_pools):
    """Single-process runs (fp32 and bf16) that also write the shared starting weights."""
    root = tmp_path_factory.mktemp("parity")
    for precision in ("fp32", "bf16"):
        run_worker(rank_pools, root / f"ref_{precision}", root / f"weights_{precision}", 1,
                   [f"model.precision={precision}"], reference=True)
    return root


def check_layout(directory: Path, nproc: int, expected: dict) -> None:
    """The run really used the layout (an ignored override must not pass as parity): Megatron's
    parallel state, and the kind of optimizer actually built, against what the config asked for."""
    reported = json.loads((directory / "losses.json").read_text())["layout"]
    assert reported["world"] == nproc
    assert reported["distributed_optimizer"] == reported["config_distributed_optimizer"], reported
    assert {k: reported[k] for k in expected} == expected, reported


def compare(reference_dir: Path, layout_dir: Path) -> dict[str, float]:
    ref_lp, got_lp = read_logprobs(reference_dir), read_logprobs(layout_dir)
    assert sorted(got_lp) == sorted(ref_lp), "the layout did not return every sample"
    lp_diff = max((got_lp[i]["logprobs"] - ref_lp[i]["logprobs"]).abs().max().item() for i in ref_lp)
    ent_diff = max((got_lp[i]["entropy"] - ref_lp[i]["entropy"]).abs().max().item() for i in ref_lp)

    ref_grads, got_grads = read_grads(reference_dir), read_grads(layout_dir)
    assert sorted(got_grads) == sorted(ref_grads)
    grad_diff = max((got_grads[k].float() - ref_grads[k].float()).abs().max().item() for k in ref_grads)
    grad_rel = max(
        ((got_grads[k].float() - ref_grads[k].float()).norm() / ref_grads[k].float().norm().clamp_min(1e-12)).item()
        for k in ref_grads
    )
    ref_loss = json.loads((reference_dir / "losses.json").read_text())["loss"]
    got_loss = json.loads((layout_dir / "losses.json").read_text())["loss"]
    loss_diff = max(abs(a - b) for a, b in zip(ref_loss, got_loss))
    assert len(got_loss) == 3
    return dict(logprobs=lp_diff, entropy=ent_diff, grad=grad_diff, grad_rel=grad_rel, loss=loss_diff)


def run_layout(ranks: RankPools, reference: Path, name: str, precision: str) -> dict[str, float]:
    nproc, overrides, layout = LAYOUTS[name]
    out = reference / f"{name}_{precision}"
    run_worker(ranks, out, reference / f"weights_{precision}", nproc, overrides + [f"model.precision={precision}"])
    check_layout(out, nproc, dict(layout, precision=precision))
    diffs = compare(reference / f"ref_{precision}", out)
    print(name, precision, diffs)
    return diffs


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process_fp32(reference, rank_pools, name):
    diffs = run_layout(rank_pools, reference, name, "fp32")
    assert diffs["logprobs"] <= FP32_TOL, diffs
    assert diffs["entropy"] <= FP32_TOL, diffs
    assert diffs["grad"] <= FP32_TOL, diffs
    assert diffs["loss"] <= FP32_TOL, diffs


@pytest.mark.parametrize("name", ["tp2_ep2_etp2"])
def test_layout_matches_single_process_bf16(reference, rank_pools, name):
    diffs = run_layout(rank_pools, reference, name, "bf16")
    assert diffs["logprobs"] <= BF16_LOGPROB_TOL, diffs
    assert diffs["grad_rel"] <= BF16_GRAD_REL_TOL, diffs
    assert diffs["loss"] <= BF16_LOSS_TOL, diffs


# GRPO-family losses from megatron_rl.algorithms through the real Megatron step: the step-global
# normalizer (compute_step_normalizer over DP) must make every layout match one process.
RECIPE_CASES = [("gspo", "dp2_distopt"), ("dapo", "tp2_ep2_etp2"), ("gspo", "pp2")]


@pytest.mark.parametrize("recipe, name", RECIPE_CASES, ids=[f"{r}-{n}" for r, n in RECIPE_CASES])
def test_recipe_loss_matches_single_process(reference, rank_pools, recipe, name):
    ref = reference / f"ref_fp32_{recipe}"
    if not (ref / "losses.json").exists():
        run_worker(rank_pools, ref, reference / "weights_fp32", 1, ["model.precision=fp32"], recipe=recipe)
    nproc, overrides, layout = LAYOUTS[name]
    out = reference / f"{name}_{recipe}"
    run_worker(rank_pools, out, reference / "weights_fp32", nproc, overrides + ["model.precision=fp32"], recipe=recipe)
    check_layout(out, nproc, dict(layout, precision="fp32"))
    diffs = compare(ref, out)
    record = json.loads((out / "losses.json").read_text())
    print(recipe, name, diffs, record["loss"], record["grad_norm"])
    # Not a vacuous match: the first step has a gradient and moves the loss. (Later GSPO steps
    # may repeat a value: with its 3e-4 clip range every sequence ratio is clipped after one step.)
    assert record["grad_norm"][0] > 1e-4 and record["loss"][1] != record["loss"][0]
    assert diffs["grad"] <= FP32_TOL and diffs["loss"] <= FP32_TOL and diffs["logprobs"] <= FP32_TOL, diffs


# LoRA (model/lora.py) on every target the tiny MoE has, the router included: adapters split with
# their weights (column / row parallel with sequence parallelism at TP2, per expert at EP2, split
# over expert-TP at TP2 x EP2 x ETP2, whole experts beside split attention at TP2 x EP2), on both
# pipeline stages at PP2, the base frozen. The reference gives every B random values before saving
# (B = 0 would leave A without a gradient in the first step), so the gradients of both A and B are
# compared. After the 3 steps, the merged HF export (W + s B A, each stage's leader its own layers)
# equals the reference's.
# TP2 x EP2 at ETP1 is run for LoRA only: the question there is the expert adapters' share of the
# gradient norm (Megatron tags its own expert weights, so the full model's share is its own).
# PP2 with full activation recomputation: each layer runs its backward only if its input requires
# grad, which a frozen embedding's output did not (model/lora.py keep_layer_inputs_differentiable):
# without it the adapters got no gradient at all (grad norm 0 here); the second stage's input
# comes from the first.
LORA_LAYOUTS = dict(LAYOUTS, tp2_ep2=(4, ["parallel.tp=2", "parallel.ep=2", "parallel.etp=1"],
                                      dict(tp=2, pp=1, ep=2, etp=1, dp=2, distributed_optimizer=True)),
                    pp2_recompute=(2, ["parallel.pp=2", "model.recompute=full"],
                                   dict(tp=1, pp=2, ep=1, etp=1, dp=1, distributed_optimizer=True)))
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[qkv,proj,experts,router]"]
# Multi-latent attention (DeepSeek-V3): qkv is its q down / up and kv down / up projections; the
# down projections get their adapters after the build (model/lora.py), and at TP2 the kv down
# projection's output goes through builder.py's k_pos_emb repair. Every default target: the dense
# first layer's MLP and the shared expert too. The tiny DeepSeek-V3 with narrower latents (its
# kv_lora_rank 512 and 64 rotary dims are most of its compute; the code paths are the same).
MLA_LORA = ["model.lora.rank=4", "model.lora.alpha=8"]
NARROW_MLA = dict(kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


@pytest.fixture(scope="module")
def lora_reference(reference, rank_pools) -> Path:
    run_worker(rank_pools, reference / "ref_lora", reference / "weights_lora", 1, ["model.precision=fp32", *LORA],
               reference=True, nonzero_adapters=True)
    return reference


@pytest.mark.parametrize("name", ["tp2", "ep2", "pp2", "tp2_ep2", "tp2_ep2_etp2", "pp2_recompute"])
def test_lora_layout_matches_single_process(lora_reference, rank_pools, name):
    nproc, overrides, layout = LORA_LAYOUTS[name]
    out = lora_reference / f"{name}_lora"
    run_worker(rank_pools, out, lora_reference / "weights_lora", nproc, overrides + ["model.precision=fp32", *LORA])
    check_layout(out, nproc, dict(layout, precision="fp32"))
    check_lora_parity(lora_reference / "ref_lora", out, name)


def test_lora_on_multi_latent_attention_at_tp2_matches_single_process(tmp_path, rank_pools):
    from megatron_rl.model.hf_config import load_hf_config

    raw, _ = load_hf_config("tiny-deepseek-v3")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(dict(raw, **NARROW_MLA)))
    settings = ["model.precision=fp32", f"model.hf_config={tmp_path / 'model'}", *MLA_LORA]
    run_worker(rank_pools, tmp_path / "ref", tmp_path / "weights", 1, settings, reference=True, nonzero_adapters=True)
    nproc, overrides, layout = LORA_LAYOUTS["tp2"]
    run_worker(rank_pools, tmp_path / "tp2", tmp_path / "weights", nproc, overrides + settings)
    check_layout(tmp_path / "tp2", nproc, dict(layout, precision="fp32"))
    grads = check_lora_parity(tmp_path / "ref", tmp_path / "tp2", "mla tp2")
    for projection in ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj"):
        for matrix in ("lora_A", "lora_B"):  # adapted, and trained through
            assert grads[f"decoder.layers.0.self_attention.{projection}.{matrix}"].abs().max() > 0, (projection, matrix)


def check_lora_parity(ref: Path, out: Path, name: str) -> dict[str, torch.Tensor]:
    """The layout's logprobs, adapter gradients, 3 steps' loss and grad norm and merged export
    equal the single process's (within FP32_TOL); returns the layout's gradients."""
    diffs = compare(ref, out)
    grads = read_grads(out)
    adapter_grads = {k: v for k, v in grads.items() if k.endswith((".lora_A", ".lora_B"))}
    ref_norms = json.loads((ref / "losses.json").read_text())["grad_norm"]
    got_norms = json.loads((out / "losses.json").read_text())["grad_norm"]
    print(name, "lora", diffs, ref_norms, got_norms)
    # Not vacuous: A and B both have gradients, and the base none.
    assert any(k.endswith(".lora_A") and v.abs().max() > 0 for k, v in adapter_grads.items())
    assert all(float(v.abs().max()) == 0 for k, v in grads.items() if k not in adapter_grads)
    assert diffs["logprobs"] <= FP32_TOL and diffs["grad"] <= FP32_TOL and diffs["loss"] <= FP32_TOL, diffs
    assert max(abs(a - b) for a, b in zip(ref_norms, got_norms)) <= FP32_TOL, (ref_norms, got_norms)
    ref_merged, got_merged = read_merged(ref), read_merged(out)
    assert ref_merged, "the reference wrote no merged export"
    assert got_merged.keys() == ref_merged.keys()  # every stage exported its layers
    merged_diff = max((got_merged[k] - ref_merged[k]).abs().max().item() for k in ref_merged)
    assert merged_diff <= FP32_TOL, merged_diff
    return grads


def read_merged(directory: Path) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("merged_rank*.pt")):
        part = torch.load(path)
        assert not merged.keys() & part.keys(), "two ranks exported the same tensor"
        merged.update(part)
    return merged
