"""The MoE sweep's report writes `megatron-rl plan --measured`'s table (step_times.jsonl) from its
own moe_perf.jsonl, so a GPU run feeds the planner with no hand work. The JSONL here is SYNTHETIC:
rows in the sweep's format (Sweep.record's keys) with made-up figures on a GPU named
"synthetic test GPU", for tiny-qwen3-moe's layer; the table's figures are re-derived by hand."""

from __future__ import annotations

import argparse
import json

import pytest

from _support.benchmark_scripts import load_benchmark
from megatron_rl.config import load_config
from megatron_rl.model.hf_config import load_hf_config, parse_hf_config
from megatron_rl.plan import measured, step_time

GPU = "synthetic test GPU"
TOKENS = 4096  # per step: two micro-batches of 2048


load = load_benchmark


def synthetic_row(case: str, ep: int, levers: list[str], sets: list[str], decoder_s: float, **extra) -> dict:
    """One phase-B line as the sweep writes it for a measured case (made-up figures)."""
    raw, _ = load_hf_config("tiny-qwen3-moe")  # 4 experts top-2, 2 layers
    local = 4 // ep
    step_s = decoder_s + 0.05
    row = {"phase": "B", "case": case, "ep": ep, "levers": levers, "set": sets, "on_cpu": False, "without": [],
           "seconds": 3.0, "status": "measured", "upper_bound": f"one GPU's compute at EP {ep}, without the all-to-all",
           "layout": {"ep": ep, "experts": 4, "local_experts": local, "top_k": 2, "rows_per_micro_batch": 4096,
                      "tokens_per_local_expert": 4096 / local, "derivation": "synthetic"},
           "model": {**raw, "num_experts": local}, "balanced_routing": True, "device": "cuda", "losses": [5.0, 4.9],
           "steps": 4, "timed_steps": 2, "tokens_per_step": TOKENS, "micro_batches_per_step": 2.0,
           "tokens_per_micro_batch": 2048.0, "flops_per_step": 1e9, "step_s": step_s, "optimizer_s": 0.01,
           "tokens_per_s": TOKENS / step_s, "tflops": 1e9 / step_s / 1e12, "peak_tflops": 989.0, "mfu": 0.01,
           "mfu_without_optimizer": 0.01, "all_updated": True, "layers": "Transformer Engine", "grouped_gemm": True,
           "split": {"decoder_s": decoder_s, "head_s": 0.02, "decoder_mfu": 0.01, "head_mfu": 0.2,
                     "head_share_of_flops": 0.1},
           "micro_batch_tokens": 2048, "routing_imbalance": 1.02, "peak_memory_gib": 1.0,
           "versions": {"torch": "synthetic"}, "gpu": GPU, "date": "2026-12-06"}
    return {**row, **extra}


@pytest.fixture(scope="module")
def sweep_table(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic-sweep")
    rows = [
        synthetic_row("EP2 baseline", 2, [], [], decoder_s=0.4),
        synthetic_row("EP2 + fused wgrad", 2, ["fused wgrad"], ["model.gradient_accumulation_fusion=true"],
                      decoder_s=0.3, loss_within_noise=True, ratio_vs_baseline=1.3),
        # a lever whose loss left the baseline's: its time is not the same computation's
        synthetic_row("EP2 + CUTLASS", 2, ["fused wgrad", "CUTLASS"],
                      ["model.gradient_accumulation_fusion=true", "model.moe_grouped_gemm_backend=cutlass"],
                      decoder_s=0.1, loss_within_noise=False),
        synthetic_row("EP1 baseline", 1, [], [], decoder_s=0.8),
        {**synthetic_row("EP1 + one micro-batch", 1, ["one micro-batch"], ["micro_batch_tokens=4096"], decoder_s=0.7),
         "status": "timed out: killed at its limit of 120 s"},
        synthetic_row("profile of 'EP2 + fused wgrad'", 2, ["fused wgrad"], ["model.gradient_accumulation_fusion=true"],
                      decoder_s=0.31, profile={"busy_share": 0.5, "step_s": 0.4, "busy_s": 0.2,
                                               "busy_share_of_profiled_step": 0.5, "table": "profile_best.txt"}),
    ]
    (out / "moe_perf.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    load("moe_perf_report").write(out, argparse.Namespace(dry_run=False))
    return out


def test_the_sweeps_report_writes_the_planners_table_from_its_jsonl(sweep_table):
    lines = [json.loads(line) for line in (sweep_table / "step_times.jsonl").read_text().splitlines()]
    # measured, within noise, not the profile rerun: EP2 baseline, EP2 + fused wgrad, EP1 baseline
    assert [line["runs"][0]["case"] for line in lines] == ["EP2 baseline", "EP2 + fused wgrad", "EP1 baseline"]
    ep2, wgrad, ep1 = lines
    # the decoder's seconds per layer and token: 0.4 s / 2 layers / 4096 tokens
    assert ep2["layer_seconds_per_token"] == pytest.approx(0.4 / 2 / 4096, rel=1e-12)
    assert ep2["head_seconds_per_token"] == pytest.approx(0.02 / 4096, rel=1e-12)
    assert (ep2["local_experts"], ep1["local_experts"], ep2["layer"]["num_experts"]) == (2, 4, 4)
    assert ep2["gpu"] == GPU and ep2["micro_batch_tokens"] == 2048 and ep2["tp"] == 1 and ep2["cp"] == 1
    assert (ep2["runs"][0]["source"], ep2["runs"][0]["date"]) == ("moe_perf.jsonl", "2026-12-06")
    assert "at EP 2 (its 2 experts), without the all-to-all: a lower bound" in ep2["note"]
    assert not ep2["settings"]["gradient_accumulation_fusion"] and wgrad["settings"]["gradient_accumulation_fusion"]
    assert ep2["settings"]["layers"] == "transformer_engine" and ep2["settings"]["precision"] == "bf16"
    assert "`step_times.jsonl`" in (sweep_table / "moe_perf.md").read_text()


def test_the_planner_times_exactly_the_layouts_of_a_measured_shape(sweep_table):
    table = measured.load_table(sweep_table / "step_times.jsonl")
    config = load_config(None, ["device=cuda", "model.precision=bf16", "micro_batch_tokens=2048"])
    arch = parse_hf_config(*load_hf_config("tiny-qwen3-moe"))
    selection = step_time.select(table, config, arch, gpu_name=None, step_tokens=None)
    assert selection.gpu == GPU and [m.line for m in selection.of_model] == [1, 2, 3]

    def found(**parallel):
        key = step_time.layout_key(config, arch, config.parallel.__class__(**parallel), GPU)
        hit = table.find(key)
        return hit.line if hit else None

    assert found(tp=1, pp=2, ep=2) == 1 and found(tp=1, pp=1, ep=1) == 3  # local experts 2 and 4, tp1
    assert found(tp=1, pp=1, ep=4) is None and found(tp=2, pp=1, ep=2, etp=1) is None
    fused = load_config(None, ["device=cuda", "model.precision=bf16", "micro_batch_tokens=2048",
                               "model.gradient_accumulation_fusion=true"])
    assert table.find(step_time.layout_key(fused, arch, fused.parallel.__class__(ep=2), GPU)).line == 2
    other = load_config(None, ["device=cuda", "model.precision=bf16", "micro_batch_tokens=4096"])
    assert table.find(step_time.layout_key(other, arch, other.parallel.__class__(ep=2), GPU)) is None


def test_a_row_the_table_cannot_read_is_named_in_the_markdown_and_the_sweep_goes_on(tmp_path):
    """The GPU sweep writes its report after every case: a measured row short of a field (a JSONL from
    before the table) must not stop it; the markdown says the table was not written and why."""
    row = synthetic_row("EP2 baseline", 2, [], [], decoder_s=0.4)
    del row["micro_batch_tokens"]
    (tmp_path / "moe_perf.jsonl").write_text(json.dumps(row) + "\n")
    load("moe_perf_report").write(tmp_path, argparse.Namespace(dry_run=False))
    assert "`step_times.jsonl` was NOT written: KeyError: 'micro_batch_tokens'" in (tmp_path / "moe_perf.md").read_text()
    assert not (tmp_path / "step_times.jsonl").exists()
