"""Weight sync into a real vLLM engine (the CPU build), checked against the trainer's own logprobs.

For a tiny dense (Qwen3, tied embeddings, also at PP2) and a tiny MoE (Qwen3-MoE) policy, in both engine modes, and for
DeepSeek-V3 (multi-latent attention, trainer and engine at TP2) colocated (GLM-4.5 and DeepSeek-V3
on one process: tests/train/test_model_families.py and tests/rollout/test_vllm_families.py):
- before training, engine and trainer agree (<= 1e-4, fp32);
- after 3 optimizer steps WITHOUT a push they disagree (> 1e-3): the comparison can fail;
- after the push they agree again (<= 1e-4), also at sampling temperature 0.6 (the engine's
  logprobs after temperature, the trainer's of logits / 0.6; > 1e-3 from the untempered ones).
  On vLLM's CPU build the MoE case fails without the expert repacking in megatron_rl/rollout/worker/extension.py, and it fails silently: this test is
  the guard;
- n samples per prompt come back grouped and in order; finish reasons are "stop" for a stop
  token and "length" for the token budget.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _support.processes import REPO, child_env, python_command, torchrun_command

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[rollout-cpu])")

WORKER = Path(__file__).with_name("sync_worker.py")
sys.path.insert(0, str(REPO / "tests" / "bridge"))
from test_bridge import family_configs, make_hf_model  # noqa: E402
from vocab_tokenizer import write_tokenizer  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.multiprocess]

SYNC_TOL = 1e-4
STALE_MIN = 1e-3

# What the engine needs beyond the bridge test's configs: vLLM's CPU MLA backend takes only head
# size 576 (kv_lora_rank 512 + rope 64); its DeepSeek model reads topk_method / scoring_func, which
# transformers does not write (the engine starts from this directory here; the trainer's engine
# directory adds them, hf_config.with_implied_keys); and expert widths the CPU MoE kernel takes
# unpadded at engine TP2 (runtime/cpu/vllm_repairs.cpu_moe_kernels).
ENGINE_OVERRIDES = {
    "deepseek_v3": dict(kv_lora_rank=512, qk_rope_head_dim=64, topk_method="noaux_tc", scoring_func="sigmoid",
                        moe_intermediate_size=64),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for name in ("qwen3", "qwen3_moe", "deepseek_v3"):
        raw = dict(family_configs()[name], **ENGINE_OVERRIDES.get(name, {}))
        make_hf_model(raw, root / name)
        write_tokenizer(root / name, raw["vocab_size"])
        dirs[name] = root / name
    return dirs


def run_sync(hf_dir: Path, out_dir: Path, mode: str, nproc: int, overrides: list[str]) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    # children=True: the servers the trainer starts are forked from the pre-imported Python too.
    command = torchrun_command(WORKER, nproc, "--hf", str(hf_dir), "--out", str(out_dir / "report.json"),
                               "--mode", mode, preloaded=True, children=True)
    for item in overrides:
        command += ["--override", item]
    env = child_env()
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        log = out_dir / "vllm-server.log"
        server = log.read_text()[-3000:] if log.exists() else ""
        raise AssertionError(f"sync worker failed ({mode}, {overrides}):\n{result.stderr[-6000:]}\n{server}")
    return json.loads((out_dir / "report.json").read_text())


CASES = [
    # (family, mode, processes, layout)
    # MoE at TP1 runs in server mode below; dense at TP1 here.
    ("qwen3", "colocated", 1, []),
    ("qwen3", "colocated", 2, ["parallel.tp=2"]),
    ("qwen3_moe", "colocated", 2, ["parallel.ep=2", "parallel.etp=1"]),
    # Servers: the trainer's rollout client starts them with dummy weights and pushes through
    # the transport. Files to one server; collective (gloo) from both pipeline stages' leaders
    # to two servers, one of them at vLLM TP2, each checked on its own.
    ("qwen3_moe", "server", 1, ["rollout.weight_transport=files"]),
    ("qwen3_moe", "server", 2, ["parallel.pp=2", "rollout.weight_transport=collective", "rollout.num_servers=2",
                                "rollout.server_tp=[1,2]"]),
    ("deepseek_v3", "colocated", 2, ["parallel.tp=2"]),
    # Tied embeddings at PP2: the trainer's last stage predicts through its own copy of the shared
    # matrix (filled on import, kept equal by the embedding group), the engine through the one
    # embedding the first stage sends.
    ("qwen3", "server", 2, ["parallel.pp=2", "rollout.weight_transport=files"]),
]


@pytest.mark.parametrize("family,mode,nproc,layout", CASES, ids=[f"{c[0]}-{c[1]}-np{c[2]}" for c in CASES])
def test_vllm_sync_matches_trainer_logprobs(models, tmp_path, family, mode, nproc, layout):
    report = run_sync(models[family], tmp_path, mode, nproc, layout)
    assert report["initial_diff"] <= SYNC_TOL, report
    # Without a push the engine serves the old weights: the same comparison must fail.
    assert report["stale_diff"] > STALE_MIN, report
    assert report["synced_diff"] <= SYNC_TOL, report
    # At temperature 0.6 engine and trainer agree on the logprobs of softmax(logits / 0.6), which
    # differ from the untempered ones (before, the engine returned and the trainer computed those).
    print(family, mode, layout, "engine vs trainer at T=0.6:", report["tempered_diffs"], "vs untempered:",
          report["untempered_diffs"], f"({report['tempered_s']:.2f} s)")
    engines = (2 if "rollout.num_servers=2" in layout else 1) if mode == "server" else 1
    assert len(report["tempered_diffs"]) == len(report["untempered_diffs"]) == engines, report
    assert max(report["tempered_diffs"]) <= SYNC_TOL, report
    assert min(report["untempered_diffs"]) > STALE_MIN, report
    if mode == "server":
        assert report["first_push_tensors"] == report["pushed_tensors"] > 0, report
        expected = 2 if "rollout.num_servers=2" in layout else 1
        for name in ("initial_diffs", "stale_diffs", "synced_diffs"):
            assert len(report[name]) == expected, report
    else:
        assert len(report["synced_diffs"]) == 2, report  # after the first push and after an in-place one
        # vLLM took this run's name for its shared memory (runtime/cpu/vllm_shm.py), the same on every rank.
        if nproc > 1:
            names = report["shm_names"]["per_rank"]
            assert names[0]["ident"].startswith("megatron-rl-") and len({str(n) for n in names}) == 1, names
            assert names[0]["group"].startswith(names[0]["ident"] + "-tp"), names
    assert report["fresh_tokens"] > 0
    assert report["pushed_tensors"] > 0
    assert report["grouping_ok"], report
    for reason, length in zip(report["length_reasons"], report["length_lengths"]):
        assert (reason, length) == ("length", 8) or (reason == "stop" and length < 8), report
    assert report["stop_reason"] == "stop", report
    assert report["stop_tokens"] == report["expected_stop_tokens"], report


def test_rollout_benchmark_quick_runs(tmp_path):
    """benchmarks/rollout.py --quick must keep working (it is not part of the suite otherwise), and
    its two generate paths must produce the same tokens (the script checks that itself)."""
    out = tmp_path / "bench.json"
    env = child_env()
    result = subprocess.run(python_command(REPO / "benchmarks" / "rollout.py", "--quick", "--rounds", "2",
                                           "--json", out, preloaded=True), env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["generated_tokens"] > 0 and report["overhead_ratio"] > 0
    assert report["colocated_push_s_per_gb"] > 0
