"""The planner's per-rank parameter, gradient and optimizer bytes equal what a real run allocates,
byte for byte, at TP2, EP2, PP2 and TP2 x EP2 (real Megatron-Core on gloo, bf16, one optimizer
step so Adam's moments exist).

The real side (state_worker.py, under torchrun) reads Megatron's own buffers and optimizer state;
the planner's side (plan_worker.py predict) builds the model on the meta device in a fake process
group and lays the buffers out by plan/state_bytes.py. The cases cover what moves the numbers:
MLA, a dense and a MoE layer with a shared expert (tiny DeepSeek-V3); expert parallelism with the
data-parallel padding landing on different ranks (EP2: dp 2, expert-dp 1); tied embeddings split
over two stages (their own bucket); the optimizer without sharding (TP2, distributed
optimizer off: full fp32 copies); and LoRA at EP2 (a frozen base, per-expert adapters)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from _support.processes import child_env, python_command
from _support.rank_pool import RankPools

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).parent
BF16 = ["model.precision=bf16"]
CASES = {
    "tp2": ("tiny-deepseek-v3", 2, ["parallel.tp=2", "parallel.distributed_optimizer=false", *BF16]),
    "ep2": ("tiny-deepseek-v3", 2, ["parallel.ep=2", *BF16]),
    "pp2": ("tiny-qwen3", 2, ["parallel.pp=2", *BF16]),
    "tp2xep2": ("tiny-deepseek-v3", 4, ["parallel.tp=2", "parallel.ep=2", "parallel.etp=1", *BF16]),
    # LoRA: the frozen base as parameters only, the adapters (per expert at EP2) with gradients,
    # fp32 main copies and moments; the router adapter (replicated, bf16) too.
    "ep2_lora": ("tiny-deepseek-v3", 2, ["parallel.ep=2", *BF16, "model.lora.rank=4",
                                         "model.lora.targets=[proj,fc1,fc2,experts,router]"]),
}
FIELDS = ("params", "grads", "main_params", "moments")


def measured(ranks: RankPools, out: Path, model: str, world: int, overrides: list[str]) -> dict[int, dict]:
    result = ranks.run(HERE / "state_worker.py", world, str(out), model, *overrides)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {r: json.loads((out / f"{model}-rank{r}.json").read_text()) for r in range(world)}


def predicted(out: Path, model: str, world: int, overrides: list[str]) -> dict[int, dict]:
    path = out / "predicted.json"
    result = subprocess.run(python_command(HERE / "plan_worker.py", "predict", path, model, world, *overrides,
                                           preloaded=True), env=child_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {int(rank): value for rank, value in json.loads(path.read_text()).items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_planner_bytes_equal_a_real_run_per_rank(rank_pools, tmp_path, case):
    model, world, overrides = CASES[case]
    real = measured(rank_pools, tmp_path, model, world, overrides)
    plan = predicted(tmp_path, model, world, overrides)
    for rank in range(world):
        assert real[rank]["updated"], f"{case} rank {rank}: the optimizer step was skipped"
        where = {k: real[rank][k] for k in ("stage", "dp_rank", "expert_dp_rank")}
        assert where == {k: plan[rank][k] for k in where}, (case, rank, where, plan[rank])
        assert {f: real[rank][f] for f in FIELDS} == {f: plan[rank][f] for f in FIELDS}, (case, rank)
        assert all(real[rank][f] > 0 for f in FIELDS), (case, rank, real[rank])
    if case == "ep2_lora":  # the frozen base dominates: adapters' gradients are a small share
        assert all(real[rank]["grads"] * 10 < real[rank]["params"] for rank in range(world)), real
    if case == "ep2":  # the distributed optimizer's slices differ between the two DP ranks
        assert real[0]["moments"] != real[1]["moments"] or real[0]["main_params"] != real[1]["main_params"]
