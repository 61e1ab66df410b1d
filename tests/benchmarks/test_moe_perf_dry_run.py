"""The MoE performance sweep's CPU dry run (`scripts/gpu_kit/run.sh --perf --dry-run`): the case
list, a process per case, moe_perf.jsonl line by line, moe_perf.md with the goals, the deadline,
with the code the GPU runs (benchmarks/moe_perf.py, moe_perf_gemm.py, moe_slice.py). Its figures
are the CPU's; the arithmetic behind them is checked against figures computed here by hand."""

import json
import subprocess

import pytest

from _support.benchmark_scripts import load_benchmark
from _support.processes import REPO, child_env, forked_python

pytestmark = pytest.mark.subprocess  # runs the kit's script, the sweep and its case processes

RUN = REPO / "scripts" / "gpu_kit" / "run.sh"
PEAK = 0.5  # TFLOP/s: a stated peak, so the MFU arithmetic runs on a CPU


load = load_benchmark


def sweep(out, *extra):
    result = subprocess.run(["bash", str(RUN), "--perf", "--dry-run", str(out), "--peak-tflops", str(PEAK), *extra],
                            env=child_env(PYTHON=forked_python()), capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in (out / "moe_perf.jsonl").read_text().splitlines()]
    return result, rows, (out / "moe_perf.md").read_text()


@pytest.fixture(scope="module")
def dry_run_out(tmp_path_factory):
    return tmp_path_factory.mktemp("moe-perf")


@pytest.fixture(scope="module")
def dry_run(dry_run_out):
    return sweep(dry_run_out)


def by_case(rows):
    return {row["case"]: row for row in rows}


def test_every_case_has_its_line_in_order_and_gpu_only_levers_are_named(dry_run):
    result, rows, md = dry_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    gemm = load("moe_perf_gemm")
    assert [r["case"] for r in rows if r["phase"] == "A"] == [c["case"] for c in gemm.cases()]
    b = [r for r in rows if r["phase"] == "B"]
    levers = ["baseline", "+ fused wgrad", "+ CUTLASS", "+ one micro-batch", "+ router fusion"]
    expected = [f"EP{ep} {lever}" for ep in (8, 1) for lever in levers]
    assert [r["case"] for r in b if not r.get("fp8") and not r.get("profile")] == expected
    assert [r["phase"] for r in rows] == ["A"] * 48 + ["B"] * 13  # 10 lever cases, 2 FP8, the profile
    cases = by_case(b)
    measured = {c for c, r in cases.items() if r["status"] == "measured"}
    lever_rows = {"EP8 baseline", "EP8 + one micro-batch", "EP1 baseline", "EP1 + one micro-batch"}
    (profile,) = measured - lever_rows
    assert measured - {profile} == lever_rows and profile[len("profile of '"):-1] in lever_rows
    for ep in (8, 1):
        for lever in ("fused wgrad", "CUTLASS", "router fusion"):
            assert cases[f"EP{ep} + {lever}"]["status"] == "gpu-only: needs CUDA and Transformer Engine (not run on CPU)"
    # A case keeps the levers before it that were measured: here only the one micro-batch.
    assert cases["EP8 + one micro-batch"]["set"] == ["micro_batch_tokens=512"]
    assert cases["EP8 + one micro-batch"]["without"] == ["fused wgrad", "CUTLASS"]
    assert cases["EP1 + router fusion"]["set"] == ["micro_batch_tokens=512", "model.moe_router_fusion=true",
                                                   "rl.updates_per_rollout=1"]
    fp8 = [r for r in b if r.get("fp8")]
    assert len(fp8) == 2 and all(r["status"].startswith("gpu-only") for r in fp8)
    assert all(r["set"][-2:] == ["model.fp8_recipe=blockwise", "model.moe_router_padding_for_fp8=true"] for r in fp8)


def test_phase_a_records_needs_te_and_its_reference_arithmetic(dry_run):
    _, rows, md = dry_run
    a = by_case(r for r in rows if r["phase"] == "A")
    assert all(r["status"] == "needs Transformer Engine" for r in a.values())
    first = a["fc1 128x341 cublas wgrad-apart"]
    assert first["flops"] == 823_828_414_464  # 6 x 128 x 341 x 2048 x 1536
    # The tiny reference: 128/32 experts, 341/64 tokens, 2048/16 -> 1536/16.
    assert first["reference"] == "pure torch on CPU, 4 x 5 tokens, 128 -> 96"
    assert first["reference_flops"] == 1_474_560  # 6 x 4 x 5 x 128 x 96
    assert first["reference_tflops"] == pytest.approx(1_474_560 / first["reference_s"] / 1e12, rel=1e-12)
    assert "| fc2 8x4096 cutlass wgrad-fused | needs Transformer Engine | pure torch on CPU, 1 x 64 tokens, 48 -> 128 |" in md


def test_phase_b_figures_follow_from_the_measured_steps(dry_run):
    _, rows, _ = dry_run
    cases = by_case(r for r in rows if r["phase"] == "B")
    for name, ep, local in (("EP8 baseline", 8, 4), ("EP1 baseline", 1, 32), ("EP8 + one micro-batch", 8, 4)):
        r = cases[name]
        assert r["upper_bound"] == f"one GPU's compute at EP {ep}, without the all-to-all: an upper bound"
        assert r["layout"]["local_experts"] == local and r["timed_steps"] == 2 and r["tokens_per_step"] == 512
        assert r["mfu"] == pytest.approx(r["flops_per_step"] / r["step_s"] / (PEAK * 1e12), rel=1e-9)
        assert r["mfu_without_optimizer"] == pytest.approx(
            r["flops_per_step"] / (r["step_s"] - r["optimizer_s"]) / (PEAK * 1e12), rel=1e-9)
        assert r["tokens_per_s"] == pytest.approx(512 / r["step_s"], rel=1e-9)
        assert r["layout"]["tokens_per_local_expert"] == pytest.approx(r["tokens_per_micro_batch"] * 2 / local)
        assert 1.0 <= r["routing_imbalance"] < 2.0 and r["balanced_routing"]
    one = cases["EP8 + one micro-batch"]
    assert one["micro_batches_per_step"] == 1 and one["layout"]["tokens_per_local_expert"] == 256  # 512 x 2 / 4
    assert one["ratio_vs_baseline"] == pytest.approx(one["tokens_per_s"] / cases["EP8 baseline"]["tokens_per_s"])
    assert one["loss_within_noise"] and one["loss_rel_diff_vs_baseline"] <= 2 ** -8


def test_markdown_has_the_goals_and_the_tables(dry_run):
    _, _, md = dry_run
    for goal in ("| emulated-EP8 BF16 model MFU (best case) | >= 30% |", "| blockwise FP8 / BF16 tokens/s at that shape | >= 1.2x |",
                 "| EP1 128-expert MoE layers MFU (best case) | >= 10% |", "| best case GPU busy share of the step | >= 80% |"):
        line = next(line for line in md.splitlines() if line.startswith(goal))
        assert line.endswith("| not measured (CPU dry run: the goals are GPU figures) |"), line
    assert "- 171 tokens x top-2 / (32 experts / EP8) = 85 tokens per local expert per micro-batch (EP8 baseline)" in md
    assert "one GPU's compute at EP 8, without the all-to-all: an upper bound" in md
    assert "| EP8 + one micro-batch | 4 | 256 | 1.0 |" in md
    assert "## Phase A: te.GroupedLinear alone" in md and "Profile of the best case" in md


def test_the_measured_cases_become_the_planners_step_time_table(dry_run, dry_run_out):
    """step_times.jsonl (megatron-rl plan --measured's table): a line per measured lever case, keyed by
    its GPU (here the dry run's marker, which the planner refuses), layer, local experts and settings."""
    from megatron_rl.plan.measured import CPU_DRY_RUN, load_table

    _, rows, _ = dry_run
    table = load_table(dry_run_out / "step_times.jsonl")
    cases = by_case(rows)
    names = ["EP8 baseline", "EP8 + one micro-batch", "EP1 baseline", "EP1 + one micro-batch"]
    assert [m.runs[0]["case"] for m in table.measurements] == names  # not the profile's rerun
    for m in table.measurements:
        row = cases[m.runs[0]["case"]]
        assert m.gpu == CPU_DRY_RUN and m.head_seconds_per_token is None  # no CUDA split: the head inside
        # the step less the optimizer, per layer (2) and token (512)
        assert m.layer_seconds_per_token == pytest.approx((row["step_s"] - row["optimizer_s"]) / 2 / 512, rel=1e-12)
        assert json.loads(m.key)["local_experts"] == row["layout"]["local_experts"] and m.layer["num_experts"] == 32
    assert [json.loads(m.key)["micro_batch_tokens"] for m in table.measurements] == [256, 512, 256, 512]


def test_a_case_cut_by_the_deadline_is_recorded_and_the_rest_not_run(tmp_path):
    # Half a second: the first case (a model build and three steps, 1.5-2 s here) is killed at it.
    result, rows, md = sweep(tmp_path, "--phases", "B", "--deadline-s", "0.5")
    assert result.returncode == 0, result.stderr[-3000:]
    cases = by_case(rows)
    assert cases["EP8 baseline"]["status"].startswith("timed out: killed at its limit of 0."), cases["EP8 baseline"]
    assert cases["EP8 + fused wgrad"]["status"].startswith("gpu-only")
    assert cases["EP8 + one micro-batch"]["status"].startswith("not run: ")
    assert cases["EP1 baseline"]["status"].endswith("s left before the 0.5 s deadline")
    assert not any(r["status"] == "measured" for r in rows) and len(rows) == 10  # no best case: no FP8, no profile
    assert "| EP8 baseline | - |" in md and md.count("not measured (CPU dry run") == 4


def test_a_lever_this_machine_cannot_run_is_reported_as_refused(tmp_path):
    """moe_slice.py writes the builder's refusal (a Transformer Engine lever on CPU) as its report."""
    result = subprocess.run([forked_python(), str(REPO / "benchmarks" / "moe_slice.py"), "--device", "cpu",
                             "--set", "model.moe_router_fusion=true", "--set", "rl.updates_per_rollout=1",
                             "--json", str(tmp_path / "r.json"), "--layers", "1", "--hidden", "64", "--heads", "4",
                             "--kv-heads", "2", "--head-dim", "16", "--experts", "8", "--top-k", "2",
                             "--expert-width", "48", "--vocab", "256", "--steps", "2", "--warmup", "1",
                             "--tokens-per-step", "256", "--micro-batch-tokens", "256", "--min-len", "16",
                             "--max-len", "128"], env=child_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    refused = json.loads((tmp_path / "r.json").read_text())["refused"]
    assert refused.startswith("model.moe_router_fusion=true is a Transformer Engine lever"), refused


def test_goal_verdicts_and_the_deadline_arithmetic():
    report, perf, slice_ = load("moe_perf_report"), load("moe_perf"), load("moe_slice")
    base = {"phase": "B", "status": "measured", "ep": 8, "tokens_per_s": 100.0, "tflops": 1.0, "mfu": 0.31,
            "case": "EP8 baseline", "losses": [2.0, 1.0]}
    fp8 = {**base, "case": "EP8 FP8", "fp8": True, "base": "EP8 baseline", "tokens_per_s": 110.0, "mfu": 0.34}
    ep1 = {**base, "ep": 1, "case": "EP1 baseline", "split": {"decoder_mfu": 0.04}}
    verdicts = [g["verdict"] for g in report.goals([base, fp8, ep1], dry_run=False)]
    assert verdicts == ["met", "not met", "not met", "not measured"]
    assert report.goals([base, fp8, ep1], dry_run=False)[1]["figure"] == "1.10x"
    assert report.against({**base, "losses": [2.0, 1.01], "tokens_per_s": 150.0}, base) == \
        {"ratio_vs_baseline": 1.5, "loss_rel_diff_vs_baseline": pytest.approx(0.005), "loss_within_noise": False}
    clock = iter([0.0, 10.0, 10.0, 95.0]).__next__
    deadline = perf.Deadline(100.0, clock=clock)
    assert deadline.limit(60.0, 1.0) == 60.0 and deadline.limit(60.0, 1.0, reserve=50.0) == 40.0
    assert deadline.limit(60.0, 10.0) is None
    assert slice_.busy_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 3.5)]) == 2.5
    # FP8 at a best BF16 setting with CUTLASS leaves CUTLASS out (no FP8 operands there; the config refuses the pair).
    best = perf.make_case(8, "EP8 + CUTLASS", perf.LEVERS[:2])
    fp8_case = perf.fp8_case(8, best)
    assert fp8_case["levers"] == ["fused wgrad", "FP8 blockwise, padded"] and fp8_case["without"] == ["CUTLASS"]
    assert perf.config_refusal(fp8_case["set"]) is None
    assert "moe_grouped_gemm_backend=cutlass with fp8_recipe='blockwise'" in perf.config_refusal(best["set"] + perf.FP8[1])
    layout = slice_.ep_layout(128, 8, 8, 16384)
    assert (layout["local_experts"], layout["tokens_per_local_expert"]) == (16, 8192)
    assert slice_.ep_layout(128, 1, 8, 16384)["tokens_per_local_expert"] == 1024
