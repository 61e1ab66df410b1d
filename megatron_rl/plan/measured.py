"""Measured step times: the table `megatron-rl plan --measured FILE` ranks layouts by.

One JSON object per line, one per per-GPU shape that was timed on a GPU:

    {"format": "megatron-rl step times 1", "gpu": "NVIDIA H200",
     "layer": {...},              # the decoder layer's shape (layer_identity: the family, widths,
                                  #   heads, experts, top-k, vocabulary for the head)
     "local_experts": 128, "tp": 1, "etp": 1, "cp": 1, "sequence_parallel": false,
     "micro_batch_tokens": 8192,  # tokens of one micro-batch on the GPU (the pack's budget)
     "settings": {...},           # what else sets the speed: precision, FP8 recipe, recompute,
                                  #   layer spec, grouped GEMM and the throughput levers (step_settings)
     "layer_seconds_per_token": 8.1e-06,   # one layer's forward + backward per token (median of runs)
     "head_seconds_per_token": 2.5e-06,    # the output head's, or null (inside the layer figure)
     "runs": [{"layer_seconds_per_token": ..., "head_seconds_per_token": ..., "source": FILE,
               "case": NAME, "date": DATE, "tokens_per_s": ..., "versions": {...}}, ...],
     "note": "..."}               # what the figure leaves out (e.g. the all-to-all of an emulated EP)

Everything before the figures is the key: a layout of the planned model on the planned GPU whose
per-GPU shape has the same key uses the figures. Written by benchmarks/moe_perf_report.py (the
sweep's step_times.jsonl) and benchmarks/step_times_fp8_moe.py (fp8_moe.py's reports); read and
checked here, every fault named by file and line before anything is planned.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

from megatron_rl.config.model import LEVERS_OFF
from megatron_rl.errors import ConfigError, not_a_file

FORMAT = "megatron-rl step times 1"
CPU_DRY_RUN = "CPU (dry run, not a GPU)"  # a sweep's dry run writes its table too; never planned with
# The decoder layer's shape: what its forward and backward compute per token. The dense MLP width
# is left out (the planner matches only models whose every layer is an MoE layer: step_time.py).
IDENTITY = ("family", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "qkv_bias", "qk_norm",
            "rotary_percent", "num_experts", "moe_top_k", "moe_ffn_hidden_size", "moe_shared_ffn_hidden_size",
            "moe_router_score", "moe_num_groups", "moe_group_topk", "vocab_size")
SETTINGS = ("precision", "fp8_recipe", "fp8_param", "recompute", "layers", "moe_grouped_gemm", "moe_token_dispatcher",
            "moe_permute_fusion", *LEVERS_OFF, "lora")
LAYOUT = ("local_experts", "tp", "etp", "cp", "micro_batch_tokens")
KEY = ("gpu", "layer", *LAYOUT, "sequence_parallel", "settings")
FIGURES = ("layer_seconds_per_token", "head_seconds_per_token")


def layer_identity(arch, experts: int | None = None) -> dict:
    """The layer's shape from an ArchitectureSpec; `experts`: the whole model's (a slice holds fewer)."""
    identity = {name: getattr(arch, name) for name in IDENTITY}
    identity["mla"] = dataclasses.asdict(arch.mla) if arch.mla is not None else None
    if experts is not None:
        identity["num_experts"] = experts
    return identity


def step_settings(config, layers: str | None = None, grouped_gemm: bool | None = None) -> dict:
    """The config's settings that change a step's speed. `layers` / `grouped_gemm`: what a measured
    run built ("Transformer Engine" or "local"); a plan resolves them as the builder does on a GPU
    (layer_spec auto: Transformer Engine; grouped GEMM: on with it)."""
    m = config.model
    te = m.layer_spec != "local" if layers is None else layers == "Transformer Engine"
    if grouped_gemm is None:
        grouped_gemm = te if m.moe_grouped_gemm is None else m.moe_grouped_gemm
    values = {"precision": m.precision, "fp8_recipe": m.fp8_recipe, "fp8_param": m.fp8_param,
              "recompute": m.recompute, "layers": "transformer_engine" if te else "local",
              "moe_grouped_gemm": grouped_gemm,
              "moe_token_dispatcher": m.moe_token_dispatcher, "moe_permute_fusion": m.moe_permute_fusion,
              **{name: getattr(m, name) for name in LEVERS_OFF}, "lora": m.lora is not None}
    return {name: values[name] for name in SETTINGS}


def entry(*, gpu: str, layer: dict, local_experts: int, micro_batch_tokens: int, settings: dict, run: dict,
          note: str, tp: int = 1, etp: int = 1, cp: int = 1, sequence_parallel: bool = False) -> dict:
    """One measurement line from one run (`run` holds its figures and provenance)."""
    return {"format": FORMAT, "gpu": gpu, "layer": layer, "local_experts": local_experts, "tp": tp, "etp": etp,
            "cp": cp, "micro_batch_tokens": micro_batch_tokens, "sequence_parallel": sequence_parallel,
            "settings": settings, **{name: run[name] for name in FIGURES}, "runs": [run], "note": note}


def key_text(line: dict) -> str:
    return json.dumps({name: line[name] for name in KEY}, sort_keys=True)


def merge(entries: list[dict]) -> list[dict]:
    """Runs of the same key in one line, the figures their median (runs of one command on one
    GPU type spread by a third: benchmarks/results/h200_2026-11-28)."""
    merged: dict[str, dict] = {}
    for line in entries:
        known = merged.setdefault(key_text(line), {**line, "runs": []})
        known["runs"] += line["runs"]
    for line in merged.values():
        for name in FIGURES:
            line[name] = _median([run[name] for run in line["runs"]])
    return list(merged.values())


def write_table(path: Path, entries: list[dict]) -> None:
    Path(path).write_text("".join(json.dumps(line) + "\n" for line in merge(entries)))


def _median(values: list):
    return None if any(v is None for v in values) else statistics.median(values)


@dataclasses.dataclass(frozen=True)
class Measurement:
    line: int
    key: str
    gpu: str
    layer: dict
    layer_seconds_per_token: float
    head_seconds_per_token: float | None
    runs: tuple
    note: str


@dataclasses.dataclass(frozen=True)
class MeasuredTable:
    path: Path
    measurements: tuple  # Measurement, in file order

    def gpus(self) -> list[str]:
        return sorted({m.gpu for m in self.measurements})

    def find(self, key: dict) -> Measurement | None:
        text = key_text(key)
        return next((m for m in self.measurements if m.key == text), None)


def load_table(path: str | Path) -> MeasuredTable:
    """The table at `path`, every line checked: ConfigError naming the file and line otherwise."""
    path = Path(path)
    why = not_a_file(path)
    if why:
        raise ConfigError(f"--measured {path} {why}")
    measurements, seen = [], {}
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        if not text.strip():
            continue
        where = f"--measured {path} line {number}"
        try:
            line = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not JSON ({exc.msg} at column {exc.colno}); the table is one JSON object per "
                              "line, as benchmarks/moe_perf_report.py writes it") from None
        measurement = _checked(line, where, number)
        if measurement.key in seen:
            raise ConfigError(f"{where}: the same GPU, layer, layout and settings as line {seen[measurement.key]}; "
                              "keep one line per shape (benchmarks' merge puts several runs in one line)")
        seen[measurement.key] = number
        measurements.append(measurement)
    if not measurements:
        raise ConfigError(f"--measured {path} holds no measurement")
    return MeasuredTable(path, tuple(measurements))


def _checked(line, where: str, number: int) -> Measurement:
    if not isinstance(line, dict):
        raise ConfigError(f"{where}: a {type(line).__name__}, not a JSON object")
    if line.get("format") != FORMAT:
        raise ConfigError(f"{where}: format {line.get('format')!r}, not {FORMAT!r}; re-write the table with this "
                          "checkout's benchmarks/moe_perf_report.py")
    missing = [name for name in (*KEY, *FIGURES, "runs", "note") if name not in line]
    if missing:
        raise ConfigError(f"{where}: no {', '.join(missing)}")
    if not isinstance(line["gpu"], str) or not line["gpu"].strip():
        raise ConfigError(f"{where}: gpu must name the GPU (torch.cuda.get_device_name), got {line['gpu']!r}")
    for name, fields in (("layer", (*IDENTITY, "mla")), ("settings", SETTINGS)):
        value = line[name]
        if not isinstance(value, dict) or set(value) != set(fields):
            have = set(value) if isinstance(value, dict) else set()
            raise ConfigError(f"{where}: {name} must hold exactly {', '.join(fields)}"
                              + (f" (missing {', '.join(sorted(set(fields) - have))})" if set(fields) - have else "")
                              + (f" (unknown {', '.join(sorted(have - set(fields)))})" if have - set(fields) else ""))
    for name in LAYOUT:
        if not _count(line[name]):
            raise ConfigError(f"{where}: {name} must be a whole number >= 1, got {line[name]!r}")
    experts = line["layer"]["num_experts"]
    if experts is not None and (not _count(experts) or experts % line["local_experts"]):
        raise ConfigError(f"{where}: local_experts {line['local_experts']} does not divide the layer's "
                          f"{experts!r} experts (local experts = experts / EP)")
    if not isinstance(line["sequence_parallel"], bool):
        raise ConfigError(f"{where}: sequence_parallel must be true or false, got {line['sequence_parallel']!r}")
    runs = line["runs"]
    if not isinstance(runs, list) or not runs or not all(isinstance(r, dict) for r in runs):
        raise ConfigError(f"{where}: runs must be a list of at least one run (its figures, source and date)")
    for index, run in enumerate(runs):
        for name in ("source", "date"):
            if not isinstance(run.get(name), str) or not run[name]:
                raise ConfigError(f"{where}: run {index + 1} has no {name} (the provenance of its figure)")
        for name in FIGURES:
            _figure(run.get(name), f"{where}: run {index + 1}'s {name}", optional=name == "head_seconds_per_token")
    for name in FIGURES:
        _figure(line[name], f"{where}: {name}", optional=name == "head_seconds_per_token")
        median = _median([run.get(name) for run in runs])
        if line[name] != median:
            raise ConfigError(f"{where}: {name} {line[name]!r} is not the median of its runs' ({median!r}); the "
                              "figure and its runs disagree (edited by hand?): re-write the table")
    if not isinstance(line["note"], str):
        raise ConfigError(f"{where}: note must be a string")
    return Measurement(number, key_text(line), line["gpu"], line["layer"], line["layer_seconds_per_token"],
                       line["head_seconds_per_token"], tuple(runs), line["note"])


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _figure(value, what: str, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{what} must be seconds above 0, got {value!r}")
