#!/usr/bin/env python
"""Our costs as the model grows: HF <-> torch_dist conversion and the weight export stream, against
a plain file copy of the same checkpoint measured in the same run.

    python benchmarks/scale.py [--sizes 1b,3b,8b] [--work DIR] [--keep] [--out benchmarks/results/scale_cpu]
    python benchmarks/scale.py --sizes small          # a few MB, the smoke test's run
    python benchmarks/scale.py --from-json benchmarks/results/scale_cpu.json   # the report again

For each size a synthetic Qwen3-MoE checkpoint with random bf16 weights is written as HF
safetensors shards (`write_synthetic_hf`: each shard's header first, then every tensor's bytes
generated in chunks of CHUNK elements, so nothing larger than a chunk is ever in memory). The
full sizes share one layer shape (Qwen3-30B-A3B's: hidden 2048, 32 query / 4 KV heads of 128,
64 experts of width 768, vocabulary 151936) and differ in depth only, so the largest tensor
(the embedding and the output layer, 151936 x 2048 bf16 = 622 MB) is the same at every size.
Then, each step timed to the end of its writes (os.sync) with the page cache dropped before it
where /proc/sys/vm/drop_caches is writable (reported; else the inputs are as warm as the last
step left them, for the reference as for the steps):

  copy         the reference: shutil.copyfile of every file of the HF directory, then fsync
  import       a process builds the bf16 model (TP1, no optimizer, weights left uninitialized)
               and loads the HF checkpoint into it (bridge.load_hf_weights, as checkpoint.init_from)
  export       then, in the same process, the trainer's weight push without engines: it iterates
               bridge.export_hf_weights (buckets of --bucket-mb, in bf16 as a bf16 engine is sent)
               and packs every bucket into the one uint8 payload the collective transport
               broadcasts (rollout/weights/group.py); no disk
  tp1 / ep2    tools/convert_hf_to_megatron.py (one process; --ep 2: two gloo ranks under torchrun,
               1 thread each) then tools/convert_megatron_to_hf.py (always one process: it reads a
               checkpoint saved at any layout), as a user runs them, then the round trip compared
               with the original tensor by tensor, bit for bit. Both conversions build the model on
               the meta device and pass the weights through one tensor or one bucket at a time
               (megatron_rl/bridge/streamed.py)

Throughput is the HF checkpoint's bytes over the wall time (a conversion's includes the
interpreter's and Megatron-Core's start-up), and its ratio to the copy's. Peak memory of a step is
per process (the largest over the ranks): VmHWM (peak RSS, which also counts the pages of files
the process maps: safetensors are read through mmap) and the peak of RssAnon (what the process
allocates), both read from /proc every 20 ms by this process; the report also gives RssAnon above
the weights the process holds (the import's live model; a conversion holds none). The export's memory above the
live model is measured inside its process (benchmarks/peak_memory.py, sampled every 2 ms).
A step whose process fails (e.g. killed for memory) is reported as failed and the run goes on;
the exit status is 1 if any step failed or any round trip differs. This process sets its
oom_score_adj to 1000 (inherited by every step), so that running out of memory ends the
benchmark's processes rather than anything else on the machine. The markdown, JSON and a plot
(time and peak memory against size) go to --out.{md,json,png}; the checkpoints are deleted as
soon as each step is done with them, and the work directory at the end (unless --keep).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

GB, MIB = 1e9, 2**20
CHUNK = 16 << 20  # elements generated at a time (32 MB of bf16)
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
# One layer shape for the full sizes (Qwen3-30B-A3B's, with 64 experts), depth picks the size.
FULL = dict(vocab_size=151936, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            intermediate_size=6144, moe_intermediate_size=768, num_experts=64, num_experts_per_tok=8)
SIZES = {
    "small": dict(vocab_size=4096, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  intermediate_size=256, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                  num_hidden_layers=2, shard_bytes=2 << 20),
    "dev": dict(FULL, vocab_size=32768, num_experts=16, num_hidden_layers=2, shard_bytes=256 << 20),
    "1b": dict(FULL, num_hidden_layers=2, shard_bytes=4 << 30),
    "3b": dict(FULL, num_hidden_layers=8, shard_bytes=4 << 30),
    "8b": dict(FULL, num_hidden_layers=23, shard_bytes=4 << 30),
}
STEPS = ("copy", "import", "export", "tp1_to_torch_dist", "tp1_to_hf", "ep2_to_torch_dist", "ep2_to_hf")


# ---- the synthetic checkpoint -------------------------------------------------------------------


def hf_config(size: str) -> dict:
    shape = {k: v for k, v in SIZES[size].items() if k != "shard_bytes"}
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **shape,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False,
            "hidden_act": "silu", "initializer_range": 0.02, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}


def hf_tensors(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Qwen3-MoE checkpoint, HF names and shapes, in the order HF writes them."""
    h, d, q, kv = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    out = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (q * d, h)),
                (p + "self_attn.k_proj.weight", (kv * d, h)), (p + "self_attn.v_proj.weight", (kv * d, h)),
                (p + "self_attn.o_proj.weight", (h, q * d)), (p + "self_attn.q_norm.weight", (d,)),
                (p + "self_attn.k_norm.weight", (d,)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate.weight", (c["num_experts"], h))]
        f = c["moe_intermediate_size"]
        for e in range(c["num_experts"]):
            out += [(f"{p}mlp.experts.{e}.gate_proj.weight", (f, h)), (f"{p}mlp.experts.{e}.up_proj.weight", (f, h)),
                    (f"{p}mlp.experts.{e}.down_proj.weight", (h, f))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab_size"], h))]


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def shards(tensors, shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    groups, size = [[]], 0
    for name, shape in tensors:
        if groups[-1] and size + 2 * numel(shape) > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += 2 * numel(shape)
    return groups


def random_bf16(rng, count: int) -> bytes:
    """`count` random bf16 values of magnitude 2^-7 .. 2^-5 (sign and 8 mantissa bits random, two
    exponents: never NaN or infinite), as little-endian bytes."""
    import numpy as np

    bits = rng.bit_generator.random_raw(-(-count // 4)).view(np.uint16)[:count]
    return ((bits & 0x80FF) | 0x3C00).astype("<u2", copy=False).tobytes()


def write_synthetic_hf(directory: Path, size: str, seed: int = 0) -> dict:
    """The checkpoint of `size` in `directory`: config.json, shards, index. Streams: each shard's
    header, then its tensors' bytes CHUNK elements at a time. Returns what was written."""
    import numpy as np

    directory.mkdir(parents=True)
    config = hf_config(size)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    rng = np.random.Generator(np.random.PCG64(seed))
    groups = shards(hf_tensors(config), SIZES[size]["shard_bytes"])
    weight_map, total = {}, 0
    for number, group in enumerate(groups, start=1):
        file = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in group:
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + 2 * numel(shape)]}
            offset += 2 * numel(shape)
            weight_map[name] = file
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        with open(directory / file, "wb") as out:
            out.write(len(encoded).to_bytes(8, "little") + encoded)
            for name, shape in group:
                left = numel(shape)
                while left:
                    out.write(random_bf16(rng, min(left, CHUNK)))
                    left -= min(left, CHUNK)
        total += offset
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    largest = max(hf_tensors(config), key=lambda t: numel(t[1]))
    experts = sum(2 * numel(shape) for name, shape in hf_tensors(config) if ".mlp.experts." in name)
    return {"params": total // 2, "bytes": total, "expert_bytes": experts, "files": len(groups),
            "tensors": len(weight_map),
            "largest_tensor": {"name": largest[0], "shape": list(largest[1]), "bytes": 2 * numel(largest[1])}}


def compare_hf(original: Path, other: Path) -> tuple[bool, str]:
    """Bit-exact comparison, one tensor at a time: same names, dtypes, shapes and bytes."""
    import torch
    from safetensors import safe_open

    def index(d):
        return json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]

    left, right = index(original), index(other)
    if set(left) != set(right):
        return False, f"names differ: {sorted(set(left) ^ set(right))[:3]}"
    for name in sorted(left):
        with safe_open(str(original / left[name]), "pt") as a, safe_open(str(other / right[name]), "pt") as b:
            x, y = a.get_tensor(name), b.get_tensor(name)
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.int16), y.view(torch.int16)):
                return False, f"{name} differs ({x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)})"
    return True, f"{len(left)} tensors bit-exact"


# ---- measuring ----------------------------------------------------------------------------------


def _status(pid: int) -> dict[str, int]:
    fields = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssAnon"):
                    fields[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return fields


def _tree(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                todo += [int(child) for child in task.read_text().split()]
            except OSError:
                pass
    return found


class TreeMemory:
    """Peak VmHWM and RssAnon of every process under `pid` (polled), and of the sum over them."""

    def __init__(self, pid: int, interval: float = 0.02):
        self.pid, self.interval, self.per_pid, self.sum_anon = pid, interval, {}, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self):
        while not self._stop.is_set():
            anon = 0
            for pid in _tree(self.pid):
                status = _status(pid)
                if not status:
                    continue
                peak = self.per_pid.setdefault(pid, {"cmd": _cmd(pid), "hwm": 0, "anon": 0})
                peak["hwm"] = max(peak["hwm"], status.get("VmHWM", 0))
                peak["anon"] = max(peak["anon"], status.get("RssAnon", 0))
                anon += status.get("RssAnon", 0)
            self.sum_anon = max(self.sum_anon, anon)
            self._stop.wait(self.interval)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        ranks = [p for p in self.per_pid.values() if "torch.distributed.run" not in p["cmd"]]
        return {"peak_rss": max((p["hwm"] for p in ranks), default=0),
                "peak_anon": max((p["anon"] for p in ranks), default=0),
                "peak_anon_all": self.sum_anon, "processes": len(ranks)}


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def settle(drop: bool) -> None:
    """Everything written so far on disk; with `drop`, the page cache emptied too."""
    os.sync()
    if drop:
        DROP_CACHES.write_text("3\n")


def run_step(command: list[str], env: dict, drop: bool) -> dict:
    settle(drop)
    load = os.getloadavg()[0]  # other work on the machine, for the record
    started = time.perf_counter()
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    memory = TreeMemory(child.pid)
    output = child.communicate()[0]
    os.sync()
    wall = time.perf_counter() - started
    result = {"wall_s": wall, **memory.stop(), "load": load}
    if child.returncode != 0:
        print(output[-5000:], file=sys.stderr)
        if child.returncode in (-9, 137) or "SIGKILL" in output:
            why = "a process was killed (SIGKILL), by the kernel for want of memory if dmesg says so"
        else:
            lines = [line.strip() for line in output.splitlines() if any(c.isalpha() for c in line)]
            why = lines[-1][-300:] if lines else "no output"
        raise StepFailed(f"{Path(command[1]).name} exited with {child.returncode}: {why}")
    return result | {"output": output}


class StepFailed(Exception):
    """A step's process failed; the run goes on with the other steps and reports it."""


def copy_tree(source: Path, target: Path) -> None:
    target.mkdir()
    for file in sorted(source.iterdir()):
        shutil.copyfile(file, target / file.name)
        with open(target / file.name, "rb+") as f:
            os.fsync(f.fileno())


def copy_step(source: Path, target: Path, drop: bool) -> dict:
    """The reference, in a child process too, so its peak memory is read the same way."""
    code = f"import sys; sys.path.insert(0, {str(REPO / 'benchmarks')!r}); import scale; " \
           f"scale.copy_tree(scale.Path({str(source)!r}), scale.Path({str(target)!r}))"
    return run_step([sys.executable, "-c", code], dict(os.environ), drop)


# ---- the export stream, in its own process -------------------------------------------------------


def export_worker(hf_dir: Path, bucket_mb: int) -> None:
    """Build the bf16 model (TP1, no optimizer), load `hf_dir`, time the export; one JSON line."""
    import torch

    from peak_memory import PeakAnonMemory
    from megatron_rl.bridge import export_hf_weights, load_hf_weights
    from megatron_rl.config import load_config
    from megatron_rl.model.builder import build_model
    from megatron_rl.rollout.weights.group import TensorMeta, pack
    from megatron_rl.runtime import start_runtime

    config = load_config(None, ["device=cpu", f"model.hf_config={hf_dir}", "model.precision=bf16"])
    runtime = start_runtime(config)
    started = time.perf_counter()
    built = build_model(config, runtime.device, initialize=False)  # every weight is loaded next
    build_s = time.perf_counter() - started
    started = time.perf_counter()
    load_hf_weights(built.module, built.arch, hf_dir)
    import_s = time.perf_counter() - started
    memory, count, size = PeakAnonMemory(), 0, 0
    memory.start()
    started = time.perf_counter()
    # dtype: what a bf16 engine is sent (the local layer spec keeps the norms in fp32).
    for bucket in export_hf_weights(built.module, built.arch, bucket_bytes=bucket_mb << 20, dtype=torch.bfloat16):
        header = json.dumps([[m.name, m.dtype, list(m.shape)] for m in (TensorMeta.of(n, t) for n, t in bucket)])
        payload = pack([torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8)] + [t for _, t in bucket],
                       runtime.device)
        count += len(bucket)
        size += sum(t.numel() * t.element_size() for _, t in bucket)
        del bucket, payload
    export_s = time.perf_counter() - started
    print(json.dumps({"build_s": build_s, "import_s": import_s, "export_s": export_s, "tensors": count,
                      "bytes": size, "peak_extra_anon": memory.peak_bytes(),
                      "model_bytes": sum(p.numel() * p.element_size() for p in built.module.parameters())}))
    runtime.shutdown()


# ---- one size -----------------------------------------------------------------------------------


def measure_size(size: str, work: Path, args, drop: bool) -> dict:
    root = work / size
    root.mkdir(parents=True)
    hf = root / "hf"
    started = time.perf_counter()
    info = write_synthetic_hf(hf, size)
    os.sync()
    info |= {"name": size, "generate_s": time.perf_counter() - started, "layers": SIZES[size]["num_hidden_layers"],
             "experts": SIZES[size]["num_experts"], "steps": {}, "round_trip": {}}
    print(f"[{size}] {info['params'] / 1e9:.2f}B parameters, {info['bytes'] / GB:.2f} GB in {info['files']} files "
          f"({info['tensors']} tensors), written in {info['generate_s']:.1f} s", flush=True)
    steps = info["steps"]

    def record(step, result):
        result.pop("output", None)
        steps[step] = result | {"bytes": info["bytes"]}
        rate = info["bytes"] / result["wall_s"] / GB
        print(f"[{size}] {step:<18} {result['wall_s']:8.1f} s {rate:6.2f} GB/s  peak RSS "
              f"{result['peak_rss'] / MIB:7.0f} MiB  peak anon {result['peak_anon'] / MIB:7.0f} MiB", flush=True)

    def failed(names, why):
        for step in names:
            steps[step] = {"failed": why}
            print(f"[{size}] {step:<18} FAILED: {why}", flush=True)

    record("copy", copy_step(hf, root / "copy", drop))
    shutil.rmtree(root / "copy")

    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(args.threads))
    try:
        worker = run_step([sys.executable, __file__, "--export-worker", str(hf), "--bucket-mb", str(args.bucket_mb)],
                          env, drop)
        numbers = json.loads(worker["output"].strip().splitlines()[-1])
        if numbers["bytes"] != info["bytes"] or numbers["tensors"] != info["tensors"]:
            raise StepFailed(f"the export yielded {numbers['tensors']} tensors, {numbers['bytes']} bytes; the "
                             f"checkpoint has {info['tensors']}, {info['bytes']}")
        process = {k: worker[k] for k in ("peak_rss", "peak_anon", "peak_anon_all", "processes", "load")}
        record("import", {"wall_s": numbers["import_s"], **process, "build_s": numbers["build_s"],
                          "process_wall_s": worker["wall_s"]})
        record("export", {"wall_s": numbers["export_s"], **process, "peak_extra_anon": numbers["peak_extra_anon"],
                          "model_bytes": numbers["model_bytes"]})
        print(f"[{size}] export peak anon above the model {numbers['peak_extra_anon'] / MIB:.0f} MiB (bucket "
              f"{args.bucket_mb} MiB, largest tensor {info['largest_tensor']['bytes'] / MIB:.0f} MiB)", flush=True)
    except StepFailed as exc:
        failed(("import", "export"), str(exc))

    for layout, flags, threads in (("tp1", [], args.threads), ("ep2", ["--ep", "2"], 1)):
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(threads))
        ckpt, back = root / f"{layout}-torch_dist", root / f"{layout}-hf"
        there, back_step = f"{layout}_to_torch_dist", f"{layout}_to_hf"
        try:
            record(there, run_step([sys.executable, str(REPO / "tools/convert_hf_to_megatron.py"), "--hf-dir", str(hf),
                                    "--out", str(ckpt), *flags], env, drop))
            steps[there]["disk_bytes"] = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
        except StepFailed as exc:
            failed((there,), str(exc))
            failed((back_step,), "not run: its input was not written")
            info["round_trip"][layout] = {"bit_exact": None, "detail": "not run: a conversion failed"}
            continue
        try:
            # One process whatever layout the checkpoint was saved at, with the TP1 step's threads.
            record(back_step, run_step([sys.executable, str(REPO / "tools/convert_megatron_to_hf.py"), "--ckpt",
                                        str(ckpt), "--out", str(back)],
                                       dict(env, OMP_NUM_THREADS=str(args.threads)), drop))
        except StepFailed as exc:
            failed((back_step,), str(exc))
            info["round_trip"][layout] = {"bit_exact": None, "detail": "not run: a conversion failed"}
            continue
        finally:
            shutil.rmtree(ckpt, ignore_errors=True)
        started = time.perf_counter()
        exact, detail = compare_hf(hf, back)
        info["round_trip"][layout] = {"bit_exact": exact, "detail": detail, "compare_s": time.perf_counter() - started}
        print(f"[{size}] {layout} round trip: {'bit-exact' if exact else 'DIFFERS'} ({detail})", flush=True)
        shutil.rmtree(back)
    if not args.keep:
        shutil.rmtree(root)
    return info


# ---- the report ---------------------------------------------------------------------------------

LABELS = {"copy": "file copy (reference)", "import": "import HF -> live model", "export": "export stream (no disk)",
          "tp1_to_torch_dist": "TP1 HF -> torch_dist", "tp1_to_hf": "TP1-saved torch_dist -> HF",
          "ep2_to_torch_dist": "EP2 HF -> torch_dist", "ep2_to_hf": "EP2-saved torch_dist -> HF"}


def fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y = a + b x: (a, b, R^2); R^2 is 1.0 for fewer than three points."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    total = sum((y - my) ** 2 for y in ys)
    r2 = 1.0 - sum((y - a - b * x) ** 2 for x, y in zip(xs, ys)) / total if total and n > 2 else 1.0
    return a, b, r2


def done(results: list[dict], step: str) -> list[dict]:
    """The sizes whose `step` ran to the end."""
    return [r for r in results if "wall_s" in r["steps"].get(step, {})]


def held(r: dict, step: str) -> int:
    """Bytes of weights a process of `step` holds by design: the import builds the live model; the
    conversions build it on the meta device and hold none (nor does the copy)."""
    return r["bytes"] if step in ("import", "export") else 0


def analyse(results: list[dict], bucket_mb: int) -> dict:
    """The three goals, per step: time linear in size, throughput >= 0.5x the copy, peak memory bounded."""
    verdict = {"linear": {}, "throughput": {}, "memory": {}}
    for step in STEPS:
        ran = done(results, step)
        if not ran:
            continue
        gb = [r["bytes"] / GB for r in ran]
        walls = [r["steps"][step]["wall_s"] for r in ran]
        a, b, r2 = fit(gb, walls)
        verdict["linear"][step] = {"sizes": [r["name"] for r in ran], "intercept_s": a, "s_per_gb": b, "r2": r2,
                                   "s_per_gb_each": [w / g for w, g in zip(walls, gb)],
                                   "met": r2 >= 0.98 if len(ran) >= 3 else None}
        if step != "copy":
            ratios = [r["steps"]["copy"]["wall_s"] / r["steps"][step]["wall_s"] for r in ran]
            # The rate on the bytes beyond the smallest size (the fits' slopes): what a fixed
            # start-up does not weigh on. Reported beside the goal, not instead of it.
            copy_slope = fit(gb, [r["steps"]["copy"]["wall_s"] for r in ran])[1]
            marginal = copy_slope / b if len(ran) >= 2 and b > 0 else None
            verdict["throughput"][step] = {"ratios": ratios, "met": min(ratios) >= 0.5, "marginal": marginal,
                                           "met_at_largest": ratios[-1] >= 0.5}
        if step == "export":
            continue  # the import's process: the export's own memory is measured above the live model (below)
        peaks = [r["steps"][step]["peak_anon"] / MIB for r in ran]
        above = [(r["steps"][step]["peak_anon"] - held(r, step)) / MIB for r in ran]
        _, slope, _ = fit(gb, peaks)
        _, slope_above, _ = fit(gb, above)
        # Bounded: grows by less than 50 MiB per GB of checkpoint (a process holding the weights: ~950).
        verdict["memory"][step] = {"peak_anon_mib": peaks, "above_weights_mib": above, "mib_per_gb": slope,
                                   "above_mib_per_gb": slope_above, "met": slope < 50 if len(ran) >= 2 else None,
                                   "above_met": slope_above < 50 if len(ran) >= 2 else None}
    ran = done(results, "export")
    if ran:
        extra = [r["steps"]["export"]["peak_extra_anon"] / MIB for r in ran]
        bound = [bucket_mb + r["largest_tensor"]["bytes"] / MIB for r in ran]
        _, slope, _ = fit([r["bytes"] / GB for r in ran], extra)
        verdict["memory"]["export_above_model"] = {
            "peak_mib": extra, "bound_mib": bound, "mib_per_gb": slope,
            "met": all(e <= 1.1 * b for e, b in zip(extra, bound)) and (slope < 50 or len(ran) < 2)}
    return verdict


def said(met) -> str:
    return "n/a (needs more sizes)" if met is None else "met" if met else "NOT MET"


def markdown(results: list[dict], verdict: dict, meta: dict) -> str:
    lines = [f"# Scale: conversion and weight export as the model grows ({meta['machine']})", "",
             f"`{meta['command']}`; {meta['date']}; {meta['versions']}.", "",
             f"Page cache: {meta['cache']}. Threads: {meta['threads']} (one process), 1 per rank (EP2 HF -> torch_dist). "
             f"Export buckets: {meta['bucket_mb']} MiB. Load average (1 min) at the start of the steps: "
             f"{meta['load']}.", "",
             "| size | parameters | bytes (bf16) | files | tensors | layers x experts | largest tensor |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        big = r["largest_tensor"]
        lines.append(f"| {r['name']} | {r['params'] / 1e9:.2f}B | {r['bytes'] / GB:.2f} GB | {r['files']} | "
                     f"{r['tensors']} | {r['layers']} x {r['experts']} | {big['name']} {big['shape']} "
                     f"({big['bytes'] / MIB:.0f} MiB) |")
    lines += ["", "Per step: wall time (to the end of its writes), the checkpoint's bytes over it, the ratio to the "
              "copy's rate, and the peak per process (the largest over the ranks): VmHWM (peak RSS; it also counts "
              "the pages of mapped files) and RssAnon (allocated memory), and RssAnon above the weights the "
              "process holds by design (the import's live model; the conversions build the model on the meta device "
              "and hold none).", "",
              "| size | step | wall s | GB/s | x copy | peak RSS MiB | peak anon MiB | anon above the weights MiB |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        for step in STEPS:
            m = r["steps"].get(step, {"failed": "not run"})
            if "wall_s" not in m:
                lines.append(f"| {r['name']} | {LABELS[step]} | failed: {m['failed']} | | | | | |")
                continue
            rate = r["bytes"] / m["wall_s"]
            lines.append(f"| {r['name']} | {LABELS[step]} | {m['wall_s']:.1f} | {rate / GB:.2f} | "
                         f"{r['steps']['copy']['wall_s'] / m['wall_s']:.2f} | {m['peak_rss'] / MIB:.0f} | "
                         f"{m['peak_anon'] / MIB:.0f} | {(m['peak_anon'] - held(r, step)) / MIB:.0f} |")
    lines += ["", "Round trips (HF -> torch_dist -> HF, compared tensor by tensor with the original):", ""]
    for r in results:
        lines.append(f"- {r['name']}: " + "; ".join(
            f"{layout} {({True: 'bit-exact', False: 'DIFFERS', None: 'not compared'})[t['bit_exact']]} ({t['detail']})"
            for layout, t in r["round_trip"].items()))
    lines += ["", "## Goals", "", "**Time linear in size** (fit wall = a + b x GB; seconds per GB at each size):", ""]
    for step, v in verdict["linear"].items():
        each = ", ".join(f"{x:.1f}" for x in v["s_per_gb_each"])
        lines.append(f"- {LABELS[step]}: {v['s_per_gb']:.1f} s/GB {v['intercept_s']:+.1f} s, R^2 {v['r2']:.4f} "
                     f"(s/GB per size: {each}): {said(v['met'])}")
    lines += ["", "**Throughput >= 0.5x the file copy:**", ""]
    for step, v in verdict["throughput"].items():
        marginal = f"; per GB beyond the fixed start-up (the fits' slopes): {v['marginal']:.2f}x" \
            if v.get("marginal") is not None else ""
        lines.append(f"- {LABELS[step]}: " + ", ".join(f"{x:.2f}x" for x in v["ratios"]) + f": {said(v['met'])}"
                     + (" (met at the largest size)" if not v["met"] and v.get("met_at_largest") else "") + marginal)
    lines += ["", "**Peak memory bounded by a constant** (peak anonymous memory per process and its growth per GB "
              "of checkpoint, met below 50 MiB/GB; then the same for the part above the weights the process holds):",
              ""]
    for step, v in verdict["memory"].items():
        if step == "export_above_model":
            lines.append("- export stream above the live model: " + ", ".join(f"{x:.0f}" for x in v["peak_mib"])
                         + " MiB against the bound one bucket + the largest tensor ("
                         + ", ".join(f"{x:.0f}" for x in v["bound_mib"]) + f" MiB), {v['mib_per_gb']:.1f} MiB/GB: "
                         + said(v["met"]))
        else:
            name = "import and export (one process)" if step == "import" else LABELS[step]
            lines.append(f"- {name}: " + ", ".join(f"{x:.0f}" for x in v["peak_anon_mib"])
                         + f" MiB ({v['mib_per_gb']:.0f} MiB/GB): {said(v['met'])}; above the weights it holds "
                         + ", ".join(f"{x:.0f}" for x in v["above_weights_mib"])
                         + f" MiB ({v['above_mib_per_gb']:.0f} MiB/GB): "
                         + ("bounded" if v["above_met"] else "n/a" if v["above_met"] is None else "NOT bounded"))
    return "\n".join(lines) + "\n"


def plot(results: list[dict], verdict: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for step in STEPS:
        ran = done(results, step)
        gb = [r["bytes"] / GB for r in ran]
        line, = left.plot(gb, [r["steps"][step]["wall_s"] for r in ran], marker="o", label=LABELS[step])
        if step != "export":  # the import's process
            right.plot(gb, [r["steps"][step]["peak_anon"] / 2**30 for r in ran], marker="o", color=line.get_color(),
                       label="import + export (one process)" if step == "import" else LABELS[step])
    right.plot([r["bytes"] / GB for r in results], [r["bytes"] / 2**30 for r in results], linestyle=":",
               color="black", label="the weights (whole model)")
    ran = done(results, "export")
    if ran:
        gb = [r["bytes"] / GB for r in ran]
        right.plot(gb, [r["steps"]["export"]["peak_extra_anon"] / 2**30 for r in ran], marker="s", linestyle="--",
                   color="black", label="export, above the live model")
        right.plot(gb, [b / 1024 for b in verdict["memory"]["export_above_model"]["bound_mib"]], linestyle=":",
                   color="gray", label="bound: bucket + largest tensor")
    left.set(xlabel="checkpoint size (GB, bf16)", ylabel="wall time (s)", title="time against size")
    right.set(xlabel="checkpoint size (GB, bf16)", ylabel="peak anonymous memory per process (GiB)",
              title="peak memory against size")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def report(results: list[dict], out: str | None, **meta) -> bool:
    """Print the markdown; with `out`, write out.md, out.json and out.png. True if every round trip is exact."""
    import torch
    import megatron.core

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    memory = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal"))) / 2**20
    loads = [m["load"] for r in results for m in r["steps"].values() if "load" in m]
    meta |= {"machine": f"{os.cpu_count()} CPU cores ({cpu}), {memory:.0f} GiB, no GPU",
             "date": time.strftime("%Y-%m-%d"),
             "versions": f"Python {platform.python_version()}, torch {torch.__version__}, "
                         f"megatron-core {megatron.core.__version__}",
             "command": "python benchmarks/scale.py " + meta.pop("options"),
             "cache": "dropped (echo 3 > /proc/sys/vm/drop_caches) after an os.sync() before every step"
                      if meta.pop("drop") else "not dropped (not writable): inputs as warm as the last step left them",
             "load": f"{min(loads):.1f} - {max(loads):.1f}" if loads else "n/a"}
    return write_report(results, out, meta)


def write_report(results: list[dict], out: str | None, meta: dict, keep_notes: bool = False) -> bool:
    """`keep_notes`: keep the hand-written section that starts with "## Notes" of the markdown there."""
    exact = all(t["bit_exact"] is True for r in results for t in r["round_trip"].values()) and \
        all("wall_s" in m for r in results for m in r["steps"].values())
    verdict = analyse(results, meta["bucket_mb"])
    text = markdown(results, verdict, meta)
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        stored = {"meta": meta, "sizes": results, "verdict": verdict}
        Path(out + ".json").write_text(json.dumps(stored, indent=1) + "\n")
        old = Path(out + ".md").read_text() if keep_notes and Path(out + ".md").is_file() else ""
        Path(out + ".md").write_text(text + (old[old.index("\n## Notes"):] if "\n## Notes" in old else ""))
        plot(results, verdict, out + ".png")
    print("every step ran and every round trip is bit-exact" if exact
          else "a step failed or a round trip is NOT bit-exact")
    return exact


# ---- main ---------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1b,3b,8b", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--work", default=None, help="where the checkpoints go (default: a new temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--out", default=None, help="results prefix (default: benchmarks/results/scale_cpu, "
                        "or only printed for --sizes small)")
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    parser.add_argument("--no-drop-caches", action="store_true")
    parser.add_argument("--from-json", default=None, help="only write the report again, from a results JSON "
                        "(keeping the markdown's hand-written '## Notes' section)")
    parser.add_argument("--export-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.export_worker:
        export_worker(Path(args.export_worker), args.bucket_mb)
        return 0
    if args.from_json:
        stored = json.loads(Path(args.from_json).read_text())
        meta = stored["meta"]
        write_report(stored["sizes"], args.out or args.from_json.removesuffix(".json"), meta, keep_notes=True)
        return 0
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown sizes {unknown}; choose from {list(SIZES)}")
    drop = not args.no_drop_caches and os.access(DROP_CACHES, os.W_OK)
    try:  # if memory runs out, the kernel ends this benchmark's processes (they inherit it) first
        Path("/proc/self/oom_score_adj").write_text("1000\n")
    except OSError:
        pass
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="scale-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work directory {work}; page cache {'dropped before each step' if drop else 'not dropped (not writable)'}",
          flush=True)
    results = []
    try:
        for size in sizes:
            results.append(measure_size(size, work, args, drop))
    finally:
        if not args.keep:
            for size in sizes:
                shutil.rmtree(work / size, ignore_errors=True)
            if not args.work:
                shutil.rmtree(work, ignore_errors=True)
    out = args.out or (None if sizes == ["small"] else str(REPO / "benchmarks/results/scale_cpu"))
    # The options that change what is measured (no paths: the results file is committed).
    options = " ".join([f"--sizes {args.sizes}", *([f"--bucket-mb {args.bucket_mb}"] if args.bucket_mb != 512 else []),
                        *(["--no-drop-caches"] if args.no_drop_caches else [])])
    exact = report(results, out, drop=drop, threads=args.threads, bucket_mb=args.bucket_mb, options=options)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
