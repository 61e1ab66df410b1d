"""`megatron-rl plan --measured`: a layout whose per-GPU shape was timed gets a step time from the
measurement, the measured layouts that fit are reordered by it among the places the heuristic gave
them (tier by tier), and every other layout keeps its place. The layouts are built by hand (their
memory figures chosen, so the heuristic's order is known) and the table is written with the
planner's own entry(); the step times are re-derived by hand."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_rl.config import load_config
from megatron_rl.model.hf_config import load_hf_config, parse_hf_config
from megatron_rl.plan import measured, report, step_time
from megatron_rl.plan.planner import GIB, Cluster, LayoutPlan, Plan, StagePlan, rank
from megatron_rl.plan.state_bytes import RankState

GPU = "synthetic test GPU"
# 4 experts top-2, made 4 layers deep so pp 1, 2 and 4 split it; the table times EP1 and EP2 (4 and
# 2 local experts) at TP1: EP2 the faster per token.
LAYER_S = {1: 3e-3, 2: 1e-3}  # seconds per layer and token (made up)
HEAD_S = 1e-3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    raw, _ = load_hf_config("tiny-qwen3-moe")
    arch = parse_hf_config({**raw, "num_hidden_layers": 4})
    config = load_config(None, ["device=cuda", "model.precision=bf16", "micro_batch_tokens=2048", "rl.prompts_per_step=8",
                                "rl.group_size=4", "rl.updates_per_rollout=2", "rollout.max_model_len=1024"])
    settings = measured.step_settings(config)
    lines = [measured.entry(gpu=GPU, layer=measured.layer_identity(arch), local_experts=4 // ep, micro_batch_tokens=2048,
                            settings=settings, note=f"synthetic EP{ep}",
                            run={"layer_seconds_per_token": LAYER_S[ep], "head_seconds_per_token": HEAD_S,
                                 "source": "synthetic", "case": f"EP{ep}", "date": "2026-12-06"})
             for ep in (1, 2)]
    path = tmp_path_factory.mktemp("measured") / "synthetic_step_times.jsonl"
    measured.write_table(path, lines)
    selection = step_time.select(measured.load_table(path), config, arch, gpu_name=None, step_tokens=None)
    return config, arch, selection


def layout(config, name: str, tp: int, pp: int, ep: int, left_gib: float) -> LayoutPlan:
    """A layout whose fullest stage leaves `left_gib` of 80 GiB (memory figures chosen, not planned)."""
    parallel = dataclasses.replace(config.parallel, tp=tp, pp=pp, ep=ep, etp=1)
    used = int((80 - left_gib) * GIB)
    stages = tuple(StagePlan(s, 4 // pp, RankState(used, 0, 0, 0), 0, pp - s, 10**9) for s in range(pp))
    plan = LayoutPlan(parallel, 8 // (tp * pp), 8 // (ep * pp), stages, 1, GIB, 1000, 40 * GIB, 80 * GIB, 0.1, 80 * GIB)
    object.__setattr__(plan, "name", name)  # the test's label only
    return plan


def names(layouts) -> list[str]:
    return [layout.name for layout in layouts]


def test_measured_layouts_are_reordered_among_their_places_and_the_rest_keep_theirs(setup):
    config, arch, selection = setup
    specs = [("A", 1, 1, 1, 60), ("U", 1, 1, 4, 55), ("B", 1, 1, 2, 50), ("T", 2, 1, 1, 70), ("D", 1, 2, 1, 65),
             ("E", 1, 2, 2, 64), ("L2", 1, 4, 1, 6), ("L", 1, 4, 2, 5), ("X", 1, 4, 4, -1)]
    built = [layout(config, *spec) for spec in specs]
    heuristic = rank(Plan(Cluster(gpus=8), list(reversed(built)), len(built)))
    # fewer stages, then TP1, then more memory left; under 10% left (L2, L) after; X does not fit
    assert names(heuristic.layouts) == ["A", "U", "B", "T", "D", "E", "L2", "L", "X"]
    timed = [dataclasses.replace(p, step=step_time.estimate(p, config, arch, selection)) for p in built]
    for p, plain in zip(timed, built):
        object.__setattr__(p, "name", plain.name)
    assert {p.name for p in timed if p.step is None} == {"U", "T", "X"}  # 1 local expert; TP2
    plan = rank(Plan(Cluster(gpus=8), list(reversed(timed)), len(timed), selection))
    # A, B, D, E hold places 0, 2, 4, 5: by time B E A D; L and L2 swap within their tier; U, T, X stay
    assert names(plan.layouts) == ["B", "U", "E", "T", "A", "D", "L", "L2", "X"]
    step = {p.name: p.step for p in timed if p.step}
    # 32,768 tokens per step (8 prompts x 4 samples x 1024) in 2 updates of 16,384; 2048-token micro-batches
    a, d = step["A"], step["D"]
    assert a.micro_batches == 1 and a.stage_seconds == pytest.approx((2048 * (4 * 3e-3 + HEAD_S),))
    assert a.seconds == pytest.approx(2 * (1 + 0) * 2048 * 13e-3)  # DP 8: one micro-batch, no bubble
    assert d.micro_batches == 2 and d.bubble == pytest.approx(1 / 3)  # DP 4; (pp - 1) / (m + pp - 1)
    assert d.seconds == pytest.approx(2 * (2 + 1) * 2048 * (2 * 3e-3 + HEAD_S))  # the last stage is the slowest
    assert step["L"].seconds == pytest.approx(2 * (4 + 3) * 2048 * (1e-3 + HEAD_S))
    assert (a.source, step["B"].source) == ("synthetic_step_times.jsonl line 1", "synthetic_step_times.jsonl line 2")


def test_the_table_says_which_rule_ranked_each_layout(setup):
    config, arch, selection = setup
    built = [layout(config, *spec) for spec in [("A", 1, 1, 1, 60), ("U", 1, 1, 4, 55), ("B", 1, 1, 2, 50)]]
    plan = rank(Plan(Cluster(gpus=8), [dataclasses.replace(p, step=step_time.estimate(p, config, arch, selection))
                                       for p in built], 3, selection))
    text = report.describe(config, arch, plan, source="synthetic", top=5, own=None, fix=None)
    rows = {line.split()[2]: line for line in text.splitlines() if line.startswith("tp1 pp1 ")}
    assert rows["ep2"].endswith("yes  measured: 20.5 s from synthetic_step_times.jsonl line 2")  # 2 x 2048 x 5e-3
    assert rows["ep1"].endswith("yes  measured: 53.2 s from synthetic_step_times.jsonl line 1")
    assert rows["ep4"].endswith("yes  heuristic")
    assert "2 of 3 layouts have one; those that fit are reordered by it among their own places" in text
    assert "  line 1: synthetic EP1" in text and "over 32,768 tokens per step (rl.prompts_per_step" in text
    assert "then the layouts with a measured step time reordered among their own places by it" in text
    as_json = report.as_json(config, arch, plan, None, None)
    assert [p["step_time"]["rule"] for p in as_json["layouts"]] == ["measured", "heuristic", "measured"]
    assert as_json["layouts"][0]["step_time"]["seconds_per_rl_step"] == pytest.approx(2 * 2048 * 5e-3)
