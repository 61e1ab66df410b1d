"""benchmarks/lora.py's figures from its inputs, in process: a small torch_dist checkpoint's bytes
(the optimizer's tensors told apart by name) and synthetic metrics rows -> the held-out
gain, median step times, lora / full ratios and the goals' verdicts in the report. No training run."""

import importlib.util

import torch
import torch.distributed.checkpoint as dcp

from _support.processes import REPO


def _benchmark():
    spec = importlib.util.spec_from_file_location("lora_benchmark", REPO / "benchmarks" / "lora.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(start: float, final: float, step_s: list[float]) -> list[dict]:
    rows = [{"step": 0, "eval/accuracy": start}]
    rows += [{"step": i + 1, "time/step_s": s, "time/train_s": s / 2, "time/generate_s": s / 4}
             for i, s in enumerate(step_s)]
    rows[-1]["eval/accuracy"] = final
    return rows


def test_figures_ratios_and_verdicts(tmp_path):
    bench = _benchmark()
    step_dir = tmp_path / "step_000004"
    dcp.save({"model.w": torch.zeros(1000, dtype=torch.float32),
              "optimizer.state.exp_avg.w": torch.zeros(10, dtype=torch.float32)},
             storage_writer=dcp.FileSystemWriter(str(step_dir / "weights")), no_dist=True)
    (step_dir / "trainer_state.json").write_text("{}")
    measured = bench.checkpoint_bytes(step_dir)
    assert measured["optimizer_bytes"] == 40 and measured["tensor_bytes"] == 4040
    assert measured["optimizer_stored_bytes"] >= 40  # torch.save's framing around the 40 bytes
    assert measured["checkpoint_bytes"] == sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())

    one = bench.summarize_run(_rows(0.4, 0.6, [1.0, 3.0, 2.0]))
    assert one["gain"] == 0.6 - 0.4 and one["step_s"] == 2.0 and one["train_s"] == 1.0 and one["step_s_p10"] == 1.0
    bytes_of = {"full": (1000, 10_000), "lora": (40, 9_000)}
    runs = []
    for seed in (1, 2):
        for arm, (final, times) in {"full": (0.8, [1.0, 1.0, 1.0]), "lora": (0.5, [1.5, 1.5, 1.5])}.items():
            runs.append({"arm": arm, "seed": seed, "loadavg": [1.0, 2.0], **bench.summarize_run(_rows(0.4, final, times)),
                         "optimizer_bytes": bytes_of[arm][0], "checkpoint_bytes": bytes_of[arm][1],
                         "tensor_bytes": bytes_of[arm][1] // 2, "base_kind": "hf" if arm == "lora" else None})
    summary = bench.summarize(runs)
    assert abs(summary["ratios"]["gain"] - 0.25) < 1e-9 and summary["ratios"]["optimizer_bytes"] == 0.04
    assert summary["met"] == {"optimizer_bytes": True, "checkpoint_bytes": False, "step_s": False, "gain": False}

    args = type("Args", (), dict(warm_start=250, warm_seed=1234, steps=3, full_lr=5e-4, lora_lr=2e-3, rank=8,
                                 alpha=16.0))()
    text = bench.report(runs, summary, {"tiny default, 1 GPU": {"full": 2000, "lora": 80}}, args, wall=60.0)
    assert "| optimizer state | 0.00 MiB | 0.00 MiB | 0.0400 | <= 0.05: met |" in text
    assert "| checkpoint on disk |" in text and "0.9000 | <= 0.05: **not met** |" in text
    assert "| checkpoint tensors (torch_dist, every tensor) | 0.00 MiB | 0.00 MiB | 0.9000 |  |" in text
    assert "the base is not counted" in text
    runs[1]["base_kind"] = None  # a LoRA checkpoint that holds its base: the report says so
    assert "NOT all LoRA checkpoints referred to their base" in bench.report(runs, summary, {}, args, wall=60.0)
    assert "| held-out gain | +0.400 | +0.100 | 0.25 | >= 0.5: **not met** |" in text
    assert "| tiny default, 1 GPU | 0.00 MiB | 0.00 MiB | 0.0400 |" in text
    assert "| RL step (`time/step_s`) | 1.000 s | 1.500 s | 1.50 | <= 1.2: **not met** |" in text
