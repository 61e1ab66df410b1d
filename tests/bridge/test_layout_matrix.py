"""Every supported family x tied / untied embeddings x parallel layout, against independent references.

Tiny random models made by transformers (4 layers, vocab 500: Megatron pads it to 512), one per
family and, where rollout engines honour it, a tied twin. Each cell, on real gloo process groups
(matrix_worker.py, one torchrun per layout running every model):
- import -> export is bit-exact: names, dtypes and values of the HF files (a tied model's shared
  matrix exported once);
- Megatron's logits of a packed batch equal transformers' (<= 1e-4, fp32), through the pipeline
  schedule at PP > 1, so the last stage's output layer is what is checked;
- 3 optimizer steps (distributed optimizer) equal one process's: the first step's loss and grad
  norm <= 1e-5 everywhere, all 3 steps' <= 1e-5 without TP (<= 1e-4 relative with TP, see
  LATER_STEP_REL_TOL), and each trained tensor's update within 1e-2 of one process's;
- a tied model at PP > 1 keeps its two copies of the shared matrix equal, bit for bit, after the
  import and after every step (the embedding group's gradient all-reduce);
- the single process's trained weights, loaded from its torch_dist checkpoint at the layout, export
  bit-exact (PP2 -> 1 and back with optimizer state: tests/checkpoint/test_resharding.py).
Cells that cannot run are refused by preflight, by name, before any process starts.

Engine logprobs after a push are checked on a sample of cells, because each needs a vLLM engine
(about a minute each): tied Qwen3 at TP1, TP2 and PP2 (server), Qwen3-MoE at EP2 and PP2 x engine
TP2, DeepSeek-V3 at TP2 (tests/rollout/test_vllm_sync.py); DeepSeek-V3 and GLM-4.5 at one process
(tests/rollout/test_vllm_families.py).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _support.rank_pool import RankPools

sys.path.insert(0, str(Path(__file__).parent))
from test_bridge import MOE, family_configs, make_hf_model  # noqa: E402

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("matrix_worker.py")
LOGIT_TOL = 1e-4
STEP_TOL = 1e-5
# After the first update, at TP: Adam divides each update by sqrt(v) + eps, so where a gradient
# entry is near zero the 1e-7 differences TP makes in it (another order of reductions) move that
# entry's update by a fraction of lr; the next steps' loss and grad norm inherit it. Measured
# (relative, steps 2-3): up to 7e-6 (Mixtral's router at TP2). Without TP every step is <= 1e-5.
LATER_STEP_REL_TOL = 1e-4
# Trained weights, per tensor: |W - W_one_process| / |W_one_process - W_start|. Measured up to
# 2.9e-3 (Mixtral at TP2, the same amplification); a lost, unreduced or misplaced update is ~1.
UPDATE_REL_TOL = 1e-2
LAYERS = 4  # pp2: 2 + 2; uneven: 1 + 3

# vLLM builds DeepSeek-V3 and GLM-4.5 with a separate lm_head whatever config.json says.
TIE_REFUSED = {"deepseek_v3", "glm4_moe"}
FAMILIES = list(family_configs())
CELLS = {f: (f, False) for f in FAMILIES} | {f"{f}_tied": (f, True) for f in FAMILIES if f not in TIE_REFUSED}

# name: (processes, overrides, MoE models only)
LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"], False),
    "pp2": (2, ["parallel.pp=2"], False),
    "pp2_uneven": (2, ["parallel.pp=2", "parallel.pp_first_stage_layers=1"], False),
    "ep2": (2, ["parallel.ep=2", "parallel.etp=1"], True),
    "tp2pp2": (4, ["parallel.tp=2", "parallel.pp=2"], False),
    "tp2ep2": (4, ["parallel.tp=2", "parallel.ep=2"], True),
}


def cells_of(layout: str) -> list[str]:
    moe_only = LAYOUTS[layout][2]
    return [name for name, (family, _) in CELLS.items() if family in MOE or not moe_only]


MATRIX = [(layout, cell) for layout in LAYOUTS for cell in cells_of(layout)]


def raw_config(family: str, tied: bool) -> dict:
    raw = dict(family_configs()[family], num_hidden_layers=LAYERS, tie_word_embeddings=tied)
    return raw


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from megatron_rl.tools.verify_hf import hf_logits, token_batch
    from matrix_worker import LOGIT_TOKENS

    root = tmp_path_factory.mktemp("matrix_models")
    dirs = {}
    for seed, (name, (family, tied)) in enumerate(CELLS.items()):
        make_hf_model(raw_config(family, tied), root / name, seed=seed)
        sequences = token_batch(family_configs()[family]["vocab_size"], LOGIT_TOKENS, seed=0)
        torch.save(hf_logits(str(root / name), sequences), root / name / "transformers_logits.pt")
        dirs[name] = root / name
    return dirs


def run_layout(ranks: RankPools, out: Path, models: dict[str, Path], nproc: int, overrides: list[str],
               cells: list[str], *extra: str) -> float:
    out.mkdir(parents=True, exist_ok=True)
    args = ["--out", str(out), *extra]
    for cell in cells:
        args += ["--model", f"{cell}={models[cell]}"]
    for item in overrides:
        args += ["--override", item]
    start = time.perf_counter()
    result = ranks.run(WORKER, nproc, *args, timeout=900)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise AssertionError(f"matrix worker failed ({overrides}):\n{result.stdout[-3000:]}\n{result.stderr[-8000:]}")
    print(f"matrix layout {overrides or 'one process'}: {len(cells)} models, {nproc} processes, {seconds:.0f} s")
    return seconds


@pytest.fixture(scope="module")
def reference(models, rank_pools, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("matrix_reference")
    run_layout(rank_pools, out, models, 1, [], list(CELLS), "--reference")
    return out


@pytest.fixture(scope="module")
def layout_runs(models, reference, rank_pools, tmp_path_factory) -> dict[str, Path]:
    """Each layout's output directory, run on first use (all cells of a layout in one torchrun)."""
    root = tmp_path_factory.mktemp("matrix_layouts")

    class Runs(dict):
        def __missing__(self, layout: str) -> Path:
            nproc, overrides, _ = LAYOUTS[layout]
            run_layout(rank_pools, root / layout, models, nproc, overrides, cells_of(layout), "--load-from",
                       str(reference))
            self[layout] = root / layout
            return self[layout]

    return Runs()


def merged(directory: Path, kind: str) -> dict[str, torch.Tensor]:
    """The HF tensors the stage leaders exported; a name exported by two ranks is an error."""
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob(f"{kind}_rank*.pt")):
        part = torch.load(path)
        twice = set(part) & set(tensors)
        assert not twice, f"{sorted(twice)[:3]} exported by more than one stage"
        tensors.update(part)
    return tensors


def hf_files(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: names differ: {sorted(set(got) ^ set(want))[:5]}"
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, (what, name, got[name].dtype, tensor.dtype)
        assert torch.equal(got[name], tensor), f"{what}: {name} differs by {(got[name] - tensor).abs().max():.3e}"


def check_cell(directory: Path, reference: Path, hf_dir: Path, cell: str, tied_stages: bool,
               tensor_parallel: bool = False, reloaded: bool = True) -> dict:
    """Every check of one cell; returns the measured differences."""
    assert_bit_exact(merged(directory, "import"), hf_files(hf_dir), f"{cell} import -> export")

    logits = torch.load(directory / "logits.pt")
    logit_diff = float((logits - torch.load(hf_dir / "transformers_logits.pt")).abs().max())
    assert logit_diff <= LOGIT_TOL, f"{cell}: max |logit diff| vs transformers {logit_diff:.3e}"

    got = json.loads((directory / "steps.json").read_text())
    want = json.loads((reference / "steps.json").read_text())
    assert all(got["updated"]) and all(want["updated"]), (got, want)
    assert want["grad_norm"][0] > 1e-3 and want["loss"][-1] < want["loss"][0], want  # the steps do something
    loss_diff = max(abs(a - b) for a, b in zip(got["loss"], want["loss"]))
    norm_diff = max(abs(a - b) for a, b in zip(got["grad_norm"], want["grad_norm"]))
    # The first step (same weights, one gradient) is held to 1e-5 everywhere.
    first = max(abs(got["loss"][0] - want["loss"][0]), abs(got["grad_norm"][0] - want["grad_norm"][0]))
    assert first <= STEP_TOL, (cell, "first step", got, want)
    if tensor_parallel:
        later = max(abs(a - b) / abs(b) for key in ("loss", "grad_norm") for a, b in zip(got[key][1:], want[key][1:]))
        assert later <= LATER_STEP_REL_TOL, (cell, "steps 2-3 relative", later, got, want)
    else:
        assert loss_diff <= STEP_TOL and norm_diff <= STEP_TOL, (cell, got, want)
    trained, trained_ref = merged(directory, "trained"), merged(reference, "trained")
    start = merged(reference, "import")
    assert sorted(trained) == sorted(trained_ref)
    update_error = max(float((trained[k] - trained_ref[k]).norm() / (trained_ref[k] - start[k]).norm().clamp_min(1e-12))
                       for k in trained_ref)
    assert update_error <= UPDATE_REL_TOL, f"{cell}: trained weights off one process's update by {update_error:.3e}"

    if tied_stages:
        # Both copies exist and are identical after the import and after each of the 3 steps.
        assert got["tied_gap"] == [0.0] * 4, f"{cell}: embedding vs last stage's copy: {got['tied_gap']}"
    else:
        assert got["tied_gap"] == [None] * 4, got["tied_gap"]

    if reloaded:
        assert_bit_exact(merged(directory, "reloaded"), trained_ref, f"{cell} one-process checkpoint loaded here")
    return dict(logits=logit_diff, loss=loss_diff, grad_norm=norm_diff, update=update_error)


def test_single_process_reference(models, reference):
    """The reference cells themselves: bit-exact round trip and logits against transformers."""
    for cell in CELLS:
        check_cell(reference / cell, reference / cell, models[cell], cell, tied_stages=False, reloaded=False)


@pytest.mark.parametrize("layout, cell", MATRIX, ids=[f"{layout}-{cell}" for layout, cell in MATRIX])
def test_cell_matches_transformers_and_one_process(models, reference, layout_runs, layout, cell):
    directory = layout_runs[layout]
    overrides = LAYOUTS[layout][1]
    tied_stages = CELLS[cell][1] and "parallel.pp=2" in overrides
    diffs = check_cell(directory / cell, reference / cell, models[cell], cell, tied_stages,
                       tensor_parallel="parallel.tp=2" in overrides)
    print(layout, cell, diffs)


REFUSED = [
    # (family, tied, layout overrides, what the refusal names)
    ("deepseek_v3", True, [], "tie_word_embeddings=True is not supported"),
    ("glm4_moe", True, [], "tie_word_embeddings=True is not supported"),
    ("qwen3", True, ["parallel.ep=2"], "ep/etp are only meaningful for MoE models"),
    ("llama", False, ["parallel.tp=2", "parallel.etp=1"], "ep/etp are only meaningful for MoE models"),
    ("mixtral", False, ["parallel.tp=2", "parallel.etp=1"], "Use etp=2 (expert tensor parallel) or ep>1"),
    ("qwen3_moe", False, ["parallel.ep=3"], "ep=3 must divide the number of experts"),
]


@pytest.mark.parametrize("family, tied, overrides, message", REFUSED,
                         ids=[f"{f}{'_tied' if t else ''}-{'-'.join(o) or 'tp1'}" for f, t, o, _ in REFUSED])
def test_unsupported_cells_are_refused_by_preflight(tmp_path, family, tied, overrides, message):
    from megatron_rl.config import load_config
    from megatron_rl.errors import ConfigError
    from megatron_rl.train.preflight import preflight

    (tmp_path / "config.json").write_text(json.dumps(raw_config(family, tied)))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        preflight(load_config(None, ["device=cpu", f"model.hf_config={tmp_path}", *overrides]))
