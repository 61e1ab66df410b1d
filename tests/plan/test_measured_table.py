"""The measured step-time table (`megatron-rl plan --measured FILE`): a malformed line or a table
that cannot apply to the planned model and GPU is refused by file and line before anything is
planned; the H200 table in benchmarks/results is what its converter makes of the fp8_moe.py runs,
and each figure is re-derived here from those runs' JSON."""

from __future__ import annotations

import json
import sys

import pytest

from _support.benchmark_scripts import load_benchmark
from _support.processes import REPO
from megatron_rl import cli
from megatron_rl.config import load_config
from megatron_rl.errors import ConfigError
from megatron_rl.model.hf_config import load_hf_config, parse_hf_config
from megatron_rl.plan import measured, planner, step_time

H200_TABLE = REPO / "benchmarks" / "results" / "step_times_h200.jsonl"
H200_RUNS = ["fp8_moe_f_h200.json", "h200_2026-11-28/fp8_moe_f.json", "h200_2026-11-28/fp8_moe_f_no_permute_fusion.json",
             "h200_2026-11-28/fp8_moe_f_permute_fusion.json"]


def tiny():
    return parse_hf_config(*load_hf_config("tiny-qwen3-moe"))


def config(*overrides):
    return load_config(None, ["device=cuda", "model.precision=bf16", *overrides])


def line(gpu="synthetic test GPU", arch=None, **changes) -> dict:
    """A valid table line for tiny-qwen3-moe at EP1 (made-up figures), with `changes` applied."""
    run = {"layer_seconds_per_token": 2e-6, "head_seconds_per_token": 1e-6, "source": "synthetic", "date": "2026-12-06"}
    entry = measured.entry(gpu=gpu, layer=measured.layer_identity(arch or tiny()), local_experts=4,
                           micro_batch_tokens=4096, settings=measured.step_settings(config()), run=run, note="")
    return {**entry, **changes}


def write(path, *lines) -> str:
    path.write_text("".join((text if isinstance(text, str) else json.dumps(text)) + "\n" for text in lines))
    return str(path)


def without(key):
    entry = line()
    del entry[key]
    return entry


MALFORMED = [
    ("{not json", "line 2: not JSON (Expecting property name"),
    (line(format="megatron-rl step times 0"), "line 2: format 'megatron-rl step times 0', not 'megatron-rl step times 1'"),
    (without("settings"), "line 2: no settings"),
    (line(layer={k: v for k, v in line()["layer"].items() if k != "vocab_size"}),
     "line 2: layer must hold exactly family, hidden_size"),
    (line(local_experts=3), "line 2: local_experts 3 does not divide the layer's 4 experts"),
    (line(micro_batch_tokens=0), "line 2: micro_batch_tokens must be a whole number >= 1, got 0"),
    (line(layer_seconds_per_token=-1.0), "line 2: layer_seconds_per_token must be seconds above 0, got -1.0"),
    (line(layer_seconds_per_token=3e-6), "line 2: layer_seconds_per_token 3e-06 is not the median of its runs' (2e-06)"),
    (line(runs=[{"layer_seconds_per_token": 2e-6, "head_seconds_per_token": 1e-6, "source": "synthetic"}]),
     "line 2: run 1 has no date"),
    (line(), "line 2: the same GPU, layer, layout and settings as line 1"),
]


@pytest.mark.parametrize("bad, message", MALFORMED, ids=[m.split(": ")[1][:30] for _, m in MALFORMED])
def test_a_malformed_line_is_refused_by_file_and_line(tmp_path, bad, message):
    path = write(tmp_path / "table.jsonl", line(), bad)  # line 1 is good
    with pytest.raises(ConfigError) as caught:
        measured.load_table(path)
    assert str(caught.value).startswith(f"--measured {path} {message}"), str(caught.value)


def test_an_empty_or_missing_table_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="holds no measurement"):
        measured.load_table(write(tmp_path / "empty.jsonl", ""))
    with pytest.raises(ConfigError, match="nothing.jsonl does not exist"):
        measured.load_table(tmp_path / "nothing.jsonl")


def test_a_table_that_cannot_apply_to_the_plan_is_refused_by_name(tmp_path):
    def select(path, arch=None, gpu_name=None):
        return step_time.select(measured.load_table(path), config(), arch or tiny(), gpu_name, None)

    other = parse_hf_config(*load_hf_config("qwen3-30b-a3b"))
    with pytest.raises(ConfigError, match=r"none of its 1 measurement\(s\) on synthetic test GPU is of "
                                          r"Qwen3MoeForCausalLM's layer \(line 1: hidden_size 2048 \(the model's 64\)"):
        select(write(tmp_path / "other.jsonl", line(arch=other, local_experts=128)))
    two = write(tmp_path / "two.jsonl", line(), line(gpu="NVIDIA H200"))
    with pytest.raises(ConfigError, match=r"on 2 GPUs \(NVIDIA H200, synthetic test GPU\): name the one planned"):
        select(two)
    assert select(two, gpu_name="nvidia h200").gpu == "NVIDIA H200"
    with pytest.raises(ConfigError, match="none on --gpu-name 'NVIDIA H100'"):
        select(two, gpu_name="NVIDIA H100")
    with pytest.raises(ConfigError, match=r"dry.jsonl line 1: measured by a CPU dry run, not on a GPU"):
        select(write(tmp_path / "dry.jsonl", line(gpu=measured.CPU_DRY_RUN)))
    with pytest.raises(ConfigError, match="has 2 dense layer"):
        select(write(tmp_path / "dense.jsonl", line()), arch=parse_hf_config(*load_hf_config("tiny-qwen3")))


def test_the_command_refuses_a_bad_table_before_planning(tmp_path, capsys, monkeypatch):
    def planning(*args, **kwargs):
        raise AssertionError("planning started before the table was refused")

    monkeypatch.setattr(planner, "plan_layouts", planning)  # a stand-in that fails if reached
    base = ["plan", "--gpus", "8", "--rollout-gpus", "8", "--hf-config", "tiny-qwen3-moe", "device=cuda"]
    bad = write(tmp_path / "bad.jsonl", line(), line(local_experts=3))
    assert cli.main([*base, "--measured", bad]) == 2
    assert f"--measured {bad} line 2: local_experts 3 does not divide" in capsys.readouterr().err
    assert cli.main([*base, "--measured", str(H200_TABLE)]) == 2  # another model's layer
    assert f"--measured {H200_TABLE}: none of its 4 measurement(s) on NVIDIA H200" in capsys.readouterr().err
    assert cli.main([*base, "--gpu-name", "NVIDIA H200"]) == 2
    assert "give --measured FILE" in capsys.readouterr().err


def test_the_h200_table_is_its_converters_output_and_each_figure_its_runs(tmp_path):
    converter = load_benchmark("step_times_fp8_moe")
    runs = [REPO / "benchmarks" / "results" / name for name in H200_RUNS]
    measured.write_table(tmp_path / "again.jsonl", [e for path in runs for e in converter.entries(path)])
    assert (tmp_path / "again.jsonl").read_text() == H200_TABLE.read_text()  # not stale, nothing by hand
    table = measured.load_table(H200_TABLE)
    arch = parse_hf_config(*load_hf_config("qwen3-30b-a3b"))  # the published model the slice is 7 layers of
    selection = step_time.select(table, config("micro_batch_tokens=8192"), arch, None, None)
    assert len(selection.of_model) == 4 and selection.gpu == "NVIDIA H200"
    by_source = {}
    for path in runs:
        report = json.loads(path.read_text())
        for variant in report["reports"]:  # the decoder's CUDA-event seconds / 7 layers / 16,384 tokens
            by_source[(str(path.relative_to(REPO)), variant["variant"])] = variant["split"]["decoder_s"] / 7 / 16384
    for m in table.measurements:
        figures = [by_source[(run["source"], run["case"])] for run in m.runs]
        assert [run["layer_seconds_per_token"] for run in m.runs] == pytest.approx(figures, rel=1e-9)
        ordered, half = sorted(figures), len(figures) // 2
        middle = ordered[half] if len(figures) % 2 else (ordered[half - 1] + ordered[half]) / 2
        assert m.layer_seconds_per_token == pytest.approx(middle, rel=1e-12)
    assert [len(m.runs) for m in table.measurements] == [3, 2, 1, 1]  # bf16, blockwise; with permutation fusion
