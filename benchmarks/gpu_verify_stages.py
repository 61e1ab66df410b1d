"""The stages of benchmarks/gpu_verify.py: each a function of (device, options) -> its report.

A report is {"figures": {name: value}, "checks": [{"check", "value", "tolerance", "ok"}]}; the
stage passes when every check is ok. Every stage runs the project's own code paths (the model
builder and Policy, bridge/fp8_export.py, model/fp8.py's recipe table, benchmarks/fp8_moe.py);
nothing here re-implements them. `device` is "cuda" on the GPU, "cpu" in the dry run (stages a-c
only), where the device under test is the CPU itself: the same code, compared with itself.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Stated before any GPU run: CUDA vs CPU for the tiny MoE policy's step at TP1 (b). fp32 runs with
# TF32 off, so only the order of reductions differs; bf16 rounds every matmul's output.
STEP_TOLERANCES = {
    "fp32": {"logprobs_max_abs": 1e-4, "loss_rel": 1e-5, "grad_norm_rel": 1e-4, "update_rel_l2": 1e-2},
    "bf16": {"logprobs_max_abs": 0.1, "loss_rel": 1e-2, "grad_norm_rel": 5e-2, "update_rel_l2": 0.25},
}
# te.Linear under each FP8 recipe against the same layer in BF16 (d): relative L2 error of the
# output and of both gradients; e4m3's 3 mantissa bits give about 2-4% per quantized operand.
TE_LINEAR_TOLERANCE = 0.1
STEP_MODEL = "tiny-qwen3-moe"


def check(name: str, value: float, tolerance: float, ok: bool | None = None) -> dict:
    return {"check": name, "value": value, "tolerance": tolerance,
            "ok": bool(value <= tolerance) if ok is None else bool(ok)}


def version_of(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# ------------------------------------------------------------------------------------------------
# a. versions
# ------------------------------------------------------------------------------------------------


def stage_versions(device: str, options: dict) -> dict:
    figures = {"python": sys.version.split()[0], "torch": torch.__version__, "torch CUDA": torch.version.cuda,
               "megatron-core": version_of("megatron-core"), "transformer-engine": version_of("transformer-engine"),
               "transformer-engine-cu13": version_of("transformer-engine-cu13"), "torchao": version_of("torchao")}
    checks = []
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        nccl = torch.cuda.nccl.version()
        figures.update({"GPU": props.name, "GPU memory GiB": round(props.total_memory / 2**30, 1),
                        "compute capability": f"{props.major}.{props.minor}", "cuDNN": torch.backends.cudnn.version(),
                        "NCCL": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)})
        checks.append(check("a CUDA GPU is visible", 0, 0, ok=True))
    if options.get("te_site"):
        loaded, detail = core_library_loads(options["te_site"])
        figures["TE core library (pruned to sm_90) loads"] = detail
        checks.append(check("TE core library loads (dlopen, its CUDA libraries, fat binaries registered)", 0, 0, ok=loaded))
    else:
        figures.update({"GPU": "none (dry run on CPU)", "cuDNN": torch.backends.cudnn.version()})
    return {"figures": figures, "checks": checks}


def core_library_loads(te_site: str) -> tuple[bool, str]:
    """Import transformer_engine.common (it loads cuDNN, NVRTC, cuRAND, then the core library) in a
    process of its own: this stage's path has no TE while the extension builds."""
    code = "import transformer_engine.common as c; print(c._TE_LIB_CTYPES._name)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([te_site, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, env=env,
                            timeout=120)
    if result.returncode == 0:
        return True, f"yes: {result.stdout.strip()}"
    return False, "no: " + " | ".join(result.stderr.strip().splitlines()[-3:])


# ------------------------------------------------------------------------------------------------
# b. the tiny MoE policy's step, device under test vs CPU
# ------------------------------------------------------------------------------------------------


def step_batches(vocab: int):
    from megatron_rl.model.packing import pack

    generator = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (96, 64, 80)]
    return [pack(samples, [8, 6, 7], pad_to_multiple=8)]


def policy_step(device: str, precision: str) -> dict:
    """One Policy.train_step of the tiny MoE policy (local layer spec, TP1) and the logprobs before it."""
    from megatron_rl.config import load_config
    from megatron_rl.model.policy import Policy
    from megatron_rl.runtime import start_runtime
    from megatron_rl.runtime.launch_env import free_port

    if device == "cuda":  # fp32 must mean fp32: TF32 matmuls would round to 10 mantissa bits
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    config = load_config(None, [f"device={device}", f"model.hf_config={STEP_MODEL}", f"model.precision={precision}",
                                "model.layer_spec=local", "optimizer.lr=1e-3"])
    runtime = start_runtime(config)
    try:
        policy = Policy(config, runtime)
        same_start(policy)
        batches = step_batches(policy.arch.vocab_size)

        def weights():
            return torch.cat([p.detach().float().flatten().cpu() for p in policy.module.parameters()])

        def loss_fn(logprobs, entropy, batch):
            mask = batch.loss_mask.to(logprobs.device)
            return -(logprobs * mask).sum() / mask.sum(), {}

        before = weights()
        logprobs = torch.cat([out["logprobs"].float().cpu() for out in policy.logprobs(batches, with_entropy=False)])
        result = policy.train_step(batches, loss_fn)
        after = weights()
    finally:
        runtime.shutdown()
    return {"logprobs": logprobs, "loss": result.loss, "grad_norm": result.grad_norm, "updated": result.updated,
            "update": after - before, "weights": after}


def same_start(policy) -> None:
    """The same starting weights in both processes: Megatron initializes on the GPU with CUDA's
    generator and on the CPU with torch's (builder.py's use_cpu_initialization), so one seed gives
    two different models (the kit's first GPU run compared those: logprobs 0.76 apart). Every
    matrix is drawn on the CPU from a generator seeded by its name; norms (ones) and biases (zeros)
    are already equal. The optimizer's main (fp32) copies are then read again from the weights."""
    import zlib

    with torch.no_grad():
        for name, param in policy.module.named_parameters():
            if param.dim() >= 2:
                generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    policy.optimizer.reload_model_params()


def step_child(device: str, out: str) -> None:
    """Entry of one step process: both precisions on one device, saved for the comparison."""
    torch.save({precision: policy_step(device, precision) for precision in STEP_TOLERANCES}, out)


def compare_steps(tested: dict, reference: dict, precision: str) -> list[dict]:
    tol = STEP_TOLERANCES[precision]

    def rel(a: float, b: float) -> float:
        return abs(a - b) / max(abs(b), 1e-30)

    update_diff = (tested["update"] - reference["update"]).norm() / reference["update"].norm().clamp_min(1e-30)
    return [
        check(f"{precision}: logprobs max |diff|", float((tested["logprobs"] - reference["logprobs"]).abs().max()),
              tol["logprobs_max_abs"]),
        check(f"{precision}: loss rel. diff", rel(tested["loss"], reference["loss"]), tol["loss_rel"]),
        check(f"{precision}: grad norm rel. diff", rel(tested["grad_norm"], reference["grad_norm"]), tol["grad_norm_rel"]),
        check(f"{precision}: updated weights, rel. L2 diff of the update", float(update_diff), tol["update_rel_l2"]),
        check(f"{precision}: both steps updated", 0, 0, ok=tested["updated"] and reference["updated"]),
    ]


def stage_policy_step(device: str, options: dict) -> dict:
    """Two processes (CUDA's and the CPU layer's patches cannot share one), started together."""
    runs = {"tested": device, "cpu": "cpu"}
    with tempfile.TemporaryDirectory(prefix="gpu-verify-step-") as scratch:
        # The CPU process must not see the GPU: the CPU layer refuses to patch Megatron where CUDA is usable.
        procs = {name: subprocess.Popen([sys.executable, __file__, "step-child", dev, f"{scratch}/{name}.pt"],
                                        env=dict(os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if dev == "cpu" else {})))
                 for name, dev in runs.items()}
        codes = {name: proc.wait() for name, proc in procs.items()}
        failed = [f"the {name} step process exited with {code}" for name, code in codes.items() if code != 0]
        if failed:
            raise RuntimeError("; ".join(failed) + " (its traceback is in this stage's log)")
        tested, reference = (torch.load(f"{scratch}/{name}.pt") for name in runs)
    checks, figures = [], {"model": STEP_MODEL, "device under test": device, "reference": "cpu"}
    for precision in STEP_TOLERANCES:
        checks += compare_steps(tested[precision], reference[precision], precision)
        figures[f"{precision} loss ({device} / cpu)"] = f"{tested[precision]['loss']:.6f} / {reference[precision]['loss']:.6f}"
        figures[f"{precision} grad norm ({device} / cpu)"] = \
            f"{tested[precision]['grad_norm']:.6f} / {reference[precision]['grad_norm']:.6f}"
        figures[f"{precision} bit-identical weights after the step"] = \
            bool(torch.equal(tested[precision]["weights"], reference[precision]["weights"]))
    return {"figures": figures, "checks": checks}


# ------------------------------------------------------------------------------------------------
# c. FP8 export, device under test vs CPU
# ------------------------------------------------------------------------------------------------


def export_weights(raw: dict) -> list[tuple[str, torch.Tensor]]:
    """HF-named bf16 weights of a model config, shaped by transformers' own module (built on meta),
    with the cases block scaling must get right planted in the first linear weight: an all-zero
    block, a lone outlier, values far below e4m3's smallest normal, a partial last block."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        fields = {k: v for k, v in raw.items() if k != "model_type"}
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(raw["model_type"], **fields))
    generator = torch.Generator().manual_seed(1)
    weights = []
    for name, param in model.named_parameters():
        tensor = (torch.randn(param.shape, generator=generator) * 0.02).to(torch.bfloat16)
        if not weights and name.endswith("q_proj.weight"):
            tensor[:128, :128] = 0
            tensor[0, 200] = 30.0
            tensor[128:256, 128:256] *= 1e-30
        weights.append((name, tensor))
    return weights


def export_models() -> dict[str, dict]:
    """The tiny MoE preset (partial blocks everywhere) and Qwen3-30B-A3B's linear shapes (one layer,
    two experts; a small vocabulary: embeddings are not quantized, only passed through)."""
    from megatron_rl.model.hf_config import load_hf_config

    tiny, _ = load_hf_config(STEP_MODEL)
    big, _ = load_hf_config("qwen3-30b-a3b")
    big = {**big, "num_hidden_layers": 1, "num_experts": 2, "num_experts_per_tok": 2, "mlp_only_layers": [], "vocab_size": 2048}
    return {STEP_MODEL: tiny, "qwen3-30b-a3b shapes": big}


def stage_fp8_export(device: str, options: dict) -> dict:
    from megatron_rl.bridge.fp8_export import dequantize_blockwise, fp8_rollout_stream
    from megatron_rl.model.hf_config import parse_hf_config

    checks, figures = [], {"device under test": device, "reference": "cpu"}
    for label, raw in export_models().items():
        arch = parse_hf_config(raw)
        weights = export_weights(raw)
        tested = [(n, t.cpu()) for n, t in fp8_rollout_stream(((n, w.to(device)) for n, w in weights), arch)]
        reference = list(fp8_rollout_stream(iter(weights), arch))
        same_names = [n for n, _ in tested] == [n for n, _ in reference]
        differing = [n for (n, a), (_, b) in zip(tested, reference)
                     if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(_bits(a), _bits(b))]
        scales = dict(reference)
        quantized = [n for n, t in reference if t.dtype == torch.float8_e4m3fn]
        worst = max(_dequantized_error(dict(weights)[n], t, scales[n + "_scale_inv"], dequantize_blockwise)
                    for n, t in reference if n in quantized)
        figures[f"{label}: tensors / quantized / bytes compared"] = \
            f"{len(reference)} / {len(quantized)} / {sum(t.numel() * t.element_size() for _, t in reference)}"
        figures[f"{label}: worst dequantization error (fraction of its block's amax)"] = f"{worst:.4g}"
        checks.append(check(f"{label}: same tensors in the same order", 0, 0, ok=same_names))
        checks.append(check(f"{label}: tensors not bit-identical (values and scales)", len(differing), 0))
        checks.append(check(f"{label}: dequantization error vs block amax", worst, 2.0 ** -4))
    return {"figures": figures, "checks": checks}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def _dequantized_error(weight, quantized, scale_inv, dequantize) -> float:
    """max |dequantized - weight| / the amax of the weight's block (e4m3: at most 2^-4)."""
    from megatron_rl.bridge.fp8_export import BLOCK

    error = (dequantize(quantized, scale_inv) - weight.float()).abs()
    amax = scale_inv.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:weight.shape[0], :weight.shape[1]]
    amax = amax * 448.0
    return float((error / amax.clamp_min(1e-30)).max())


def wait_for_te_build(options: dict) -> None:
    """Block until run.sh's background build of TE's PyTorch extension has ended; raise if it failed.
    Without a build file (TE installed otherwise) there is nothing to wait for."""
    rc_file = options.get("te_build_rc")
    if not rc_file:
        return
    rc_file = Path(rc_file)
    started = time.perf_counter()
    while not rc_file.exists():
        time.sleep(1)
    print(f"waited {time.perf_counter() - started:.0f} s for the extension build", flush=True)
    code = rc_file.read_text().strip()
    if code != "0":
        log = rc_file.with_suffix(".log")
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:]) if log.exists() else ""
        raise RuntimeError(f"Transformer Engine's PyTorch extension did not build (exit {code}; {log}):\n{tail}")


# ------------------------------------------------------------------------------------------------
# d. Transformer Engine: the FP8 verdicts and te.Linear under each recipe
# ------------------------------------------------------------------------------------------------


def te_recipe(name: str):
    """TE's recipe object for one of our recipe names, with the format model/fp8.py assigns it."""
    from transformer_engine.common import recipe

    from megatron_rl.model.fp8 import RECIPES

    fmt = {"hybrid": recipe.Format.HYBRID, "e4m3": recipe.Format.E4M3}[RECIPES[name].fp8_format]
    builders = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling,
                "blockwise": recipe.Float8BlockScaling, "mxfp8": recipe.MXFP8BlockScaling}
    return builders[name](fp8_format=fmt)


def te_linear_errors(name: str, tokens: int = 2048, width: int = 2048) -> dict:
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    layer = te.Linear(width, width, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)

    def run(fp8: bool):
        x.grad, layer.weight.grad = None, None
        with te.autocast(enabled=fp8, recipe=te_recipe(name) if fp8 else None):  # TE >= 2.10's spelling
            y = layer(x)
        y.backward(grad)
        return y.detach().float(), x.grad.float(), layer.weight.grad.float()

    reference = run(False)
    for _ in range(3):  # delayed scaling needs amax history before its scales settle
        quantized = run(True)

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    return {what: rel(q, r) for what, q, r in zip(("output", "input grad", "weight grad"), quantized, reference)}


def stage_transformer_engine(device: str, options: dict) -> dict:
    from megatron_rl.model.fp8 import RECIPES, detect_hardware, unmet_need

    import transformer_engine.pytorch as te  # the built extension and the pruned core library load


    hardware = detect_hardware(torch.device("cuda", 0))
    figures = {"hardware": hardware.describe(), "transformer_engine.pytorch loaded from": str(Path(te.__file__).parent),
               "TE's own verdicts": {k: f"{ok} ({why})" if why else str(ok) for k, (ok, why) in hardware.te_support.items()}}
    checks = []
    for name in RECIPES:
        problem = unmet_need(name, hardware)
        figures[f"{name}: project verdict"] = problem or "supported"
        if problem or name == "mxfp8":
            continue
        errors = te_linear_errors(name)
        for what, error in errors.items():
            checks.append(check(f"te.Linear {name}: {what} rel. L2 error vs BF16", error, TE_LINEAR_TOLERANCE))
    checks.append(check("Hopper runs delayed, current and blockwise (project verdicts)", 0, 0,
                        ok=all(unmet_need(n, hardware) is None for n in ("delayed", "current", "blockwise"))))
    return {"figures": figures, "checks": checks}


# ------------------------------------------------------------------------------------------------
# e, f. benchmarks/fp8_moe.py: the TE layer spec end to end
# ------------------------------------------------------------------------------------------------


def run_fp8_moe(args: list[str], out_dir: Path, label: str, timeout_s: float) -> dict:
    md, js = out_dir / f"fp8_moe_{label}.md", out_dir / f"fp8_moe_{label}.json"
    command = [sys.executable, str(REPO / "benchmarks" / "fp8_moe.py"), *args, "--out", str(md), "--json", str(js)]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, timeout=timeout_s)
    return {**json.loads(js.read_text()), "label": label}


def summarize_fp8_moe(result: dict, tolerance: float, split: bool) -> dict:
    figures, checks = {"table": f"fp8_moe_{result['label']}.md"}, []
    bf16 = next((r for r in result["reports"] if r["variant"] == "bf16" and "losses" in r), None)
    for r in result["reports"]:
        if "losses" not in r:
            figures[r["variant"]] = r.get("skipped") and f"skipped: {r['skipped']}" or f"failed: {r.get('error')}"
            if "error" in r:
                checks.append(check(f"{r['variant']} ran", 1, 0))
            continue
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a (unknown peak)"
        line = {"tokens/s": round(r["tokens_per_s"]), "MFU": mfu, "peak GiB": round(r["peak_memory_gib"], 1),
                "final loss": round(r["losses"][-1], 4), "layers": r["layers"], "grouped GEMM": r["grouped_gemm"]}
        if split and "split" in r:
            part = r["split"]
            for name, key in (("MoE layers", "decoder"), ("output head", "head")):
                line[f"{name} s/step"] = round(part[f"{key}_s"], 4)
                line[f"{name} MFU"] = f"{part[f'{key}_mfu']:.1%}" if f"{key}_mfu" in part else "n/a"
        if bf16 and r is not bf16:
            diff = sum(abs(a - b) / abs(b) for a, b in zip(r["losses"], bf16["losses"])) / len(bf16["losses"])
            line["mean rel. loss diff vs BF16"] = round(diff, 4)
            checks.append(check(f"{r['variant']}: mean rel. loss diff vs BF16", diff, tolerance))
        checks.append(check(f"{r['variant']}: losses finite", 0, 0, ok=all(math.isfinite(x) for x in r["losses"])))
        figures[r["variant"]] = line
    return {"figures": figures, "checks": checks}


def stage_te_end_to_end(device: str, options: dict) -> dict:
    from megatron_rl.model.fp8 import RECIPES, detect_hardware, unmet_need

    hardware = detect_hardware(torch.device("cuda", 0))
    recipes = [name for name in RECIPES if unmet_need(name, hardware) is None]
    args = ["--layers", "4", "--hidden", "1024", "--heads", "8", "--kv-heads", "4", "--head-dim", "128",
            "--experts", "16", "--top-k", "2", "--expert-width", "1024", "--vocab", "32768", "--steps", "20",
            "--warmup", "5", "--tokens-per-step", "16384", "--micro-batch-tokens", "8192", "--min-len", "256",
            "--max-len", "2048", "--recipes", "bf16", *recipes]
    result = run_fp8_moe(args, Path(options["out_dir"]), "e", options["timeout_s"])
    report = summarize_fp8_moe(result, tolerance=0.05, split=False)
    for name in RECIPES:
        if name not in recipes:
            report["figures"][name] = f"not run: {unmet_need(name, hardware)}"
    return report


def slice_layers(memory_bytes: int) -> int:
    """Qwen3-30B-A3B-shaped layers that fit with the 311M-parameter head and embedding: 18 bytes a
    parameter (bf16 weight, fp32 main grad, fp32 master and two Adam moments) on 60% of the GPU."""
    per_layer = 2048 * 128 * (32 + 4 + 4) + 32 * 128 * 2048 + 2048 * 128 + 128 * 3 * 2048 * 768
    head_and_embedding = 2 * 151_936 * 2048
    return max(1, min(8, int((0.6 * memory_bytes / 18 - head_and_embedding) // per_layer)))


def stage_qwen3_slice(device: str, options: dict) -> dict:
    layers = slice_layers(torch.cuda.get_device_properties(0).total_memory)
    args = ["--layers", str(layers), "--hidden", "2048", "--heads", "32", "--kv-heads", "4", "--head-dim", "128",
            "--experts", "128", "--top-k", "8", "--expert-width", "768", "--vocab", "151936", "--steps", "10",
            "--warmup", "3", "--tokens-per-step", "16384", "--micro-batch-tokens", "8192", "--min-len", "512",
            "--max-len", "4096", "--recipes", "bf16", "blockwise", "--split-time"]
    result = run_fp8_moe(args, Path(options["out_dir"]), "f", options["timeout_s"])
    report = summarize_fp8_moe(result, tolerance=0.05, split=True)
    report["figures"]["layers"] = layers
    return report


STAGES = {"a": stage_versions, "b": stage_policy_step, "c": stage_fp8_export, "d": stage_transformer_engine,
          "e": stage_te_end_to_end, "f": stage_qwen3_slice}


if __name__ == "__main__":
    if sys.argv[1] == "step-child":
        step_child(sys.argv[2], sys.argv[3])
