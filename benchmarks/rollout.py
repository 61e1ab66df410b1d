"""Rollout engine overhead and weight-push speed, measured against references in the same run.

1. Generation: tokens/s through our engine wrapper (`VllmColocatedEngine.generate`: per-prompt
   seeds, conversion to Samples, grouping checks) vs raw `vllm.LLM.generate` on the SAME engine
   instance, the same prompts and the same seeds, alternating, median of several rounds.
   Reported: overhead ratio = raw tokens/s / wrapper tokens/s (1.00 = no overhead). The two runs
   must produce the same tokens, which the script checks.
2. Weight push: seconds for the full model, Megatron policy -> bridge export -> engine, colocated
   (same-process stream) and, with --server, into an HTTP server through safetensors files
   (written by the trainer side, read by the server's workers). Each is measured twice: with
   in-place updates (the default: after the first push the worker copies straight into the
   engine's parameters and redoes only the packing the CPU kernels need) and with vLLM's full
   layer-wise reload (what every push did before). Reference: one memory copy of the same
   tensors (`torch.Tensor.copy_` into pre-touched memory), measured in the same run,
   interleaved with the push rounds; every figure is a median over rounds. The worker's own
   profile of each push (rollout/worker/extension.py `_reload`: time waiting on the stream, i.e. export or
   file reads, in-place copies, GEMM re-packing, MoE re-packing; or vLLM's reload and the
   repairs after it) is printed as seconds and as multiples of the memory copy.

    python benchmarks/rollout.py             # ~2 min on 2 CPU cores
    python benchmarks/rollout.py --server    # adds the HTTP server push (~2 more minutes)
    python benchmarks/rollout.py --quick     # smaller, for the test suite
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the test helpers' package, _support, that test_bridge imports
sys.path.insert(0, str(REPO / "tests" / "bridge"))
sys.path.insert(0, str(REPO / "tests" / "rollout"))


def model_config(quick: bool) -> dict:
    from megatron_rl.model.hf_config import load_hf_config

    raw, _ = load_hf_config("tiny-qwen3-moe")
    if quick:
        return dict(raw, vocab_size=512)
    # Large enough that the push is dominated by bytes, not per-tensor overhead (~0.3 GB fp32).
    return dict(raw, vocab_size=32000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512,
                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--server", action="store_true", help="also measure the push into an HTTP server")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args()

    from test_bridge import make_hf_model
    from vocab_tokenizer import write_tokenizer

    from megatron_rl.bridge import load_hf_weights
    from megatron_rl.config import load_config
    from megatron_rl.model.policy import Policy
    from megatron_rl.runtime import start_runtime
    from megatron_rl.rollout import SamplingParams, hf_weight_stream
    from megatron_rl.rollout.engines.vllm_colocated import VllmColocatedEngine

    work = Path(tempfile.mkdtemp(prefix="rollout-bench-"))
    raw = model_config(args.quick)
    make_hf_model(raw, work / "hf")
    write_tokenizer(work / "hf", raw["vocab_size"])

    config = load_config(None, ["device=cpu", f"model.hf_config={work / 'hf'}", f"output_dir={work}"])
    runtime = start_runtime(config)
    policy = Policy(config, runtime)
    load_hf_weights(policy.module, policy.arch, work / "hf")
    engine = VllmColocatedEngine(work / "hf", dtype="float32", max_model_len=512, seed=0, cache_dir=work / "cache")
    results: dict = {"model_parameters": sum(p.numel() for p in policy.module.parameters())}

    # ---- 1. generation overhead ----------------------------------------------------------------
    from vllm.inputs import TokensPrompt

    from megatron_rl.rollout.engines.vllm_common import to_vllm_sampling

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, raw["vocab_size"], (int(n),), generator=generator).tolist()
               for n in torch.randint(8, 48, (8 if args.quick else 32,), generator=generator)]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=16 if args.quick else 64, seed=11)

    def raw_generate():
        outputs = engine._llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                       [to_vllm_sampling(params, i) for i in range(len(prompts))], use_tqdm=False)
        return [[list(c.token_ids) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outputs]

    def wrapped_generate():
        return [[s.response_token_ids for s in group] for group in engine.generate(prompts, params)]

    raw_generate()  # warm-up (allocations, first-call paths)
    raw_times, wrapped_times, tokens = [], [], None
    for _ in range(args.rounds):
        for label, fn, times in (("raw", raw_generate, raw_times), ("wrapped", wrapped_generate, wrapped_times)):
            started = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - started)
            count = sum(len(t) for group in out for t in group)
            if tokens is None:
                tokens, reference = count, out
            elif out != reference:
                raise SystemExit(f"{label} generation differs from the first run: seeds are not honoured")
    raw_tps = tokens / statistics.median(raw_times)
    wrapped_tps = tokens / statistics.median(wrapped_times)
    results.update(generated_tokens=tokens, raw_tokens_per_s=raw_tps, wrapper_tokens_per_s=wrapped_tps,
                   overhead_ratio=raw_tps / wrapped_tps)

    # ---- 2. weight push -----------------------------------------------------------------------
    stream = lambda destination: hf_weight_stream(policy.module, policy.arch, destination=destination)  # noqa: E731
    nbytes = sum(t.numel() * t.element_size() for _, t in stream("all"))
    gb = nbytes / 1e9

    def memcopy() -> float:
        sources = [t for _, t in stream("all")]
        targets = [torch.zeros_like(t) for t in sources]  # touched now: the copy then measures bandwidth, not page faults
        started = time.perf_counter()
        for target, source in zip(targets, sources):
            target.copy_(source)
        return time.perf_counter() - started

    def export() -> float:
        started = time.perf_counter()
        for _ in stream("all"):
            pass
        return time.perf_counter() - started

    def colocated(in_place: bool) -> tuple[list[float], list[dict]]:
        engine._llm.collective_rpc("set_in_place_weight_updates", args=(in_place,))
        engine.update_weights(stream("all"))  # warm-up; with in_place, the push that plans
        times, profiles = [], []
        for _ in range(args.rounds):
            copy_times.append(memcopy())  # interleaved with the pushes: the same machine state
            started = time.perf_counter()
            engine.update_weights(stream("all"))
            times.append(time.perf_counter() - started)
            profiles.append(engine._llm.collective_rpc("weight_update_profile")[0])
        return times, profiles

    copy_times: list[float] = []
    export_s = statistics.median(export() for _ in range(args.rounds))
    full_times, full_profiles = colocated(in_place=False)
    push_times, push_profiles = colocated(in_place=True)
    if {p["path"] for p in push_profiles} != {"in_place"}:
        raise SystemExit(f"colocated pushes did not run in place: {push_profiles[-1]}")
    copy_s = statistics.median(copy_times)
    push_s, full_s = statistics.median(push_times), statistics.median(full_times)
    results.update(weights_gb=gb, memcopy_s=copy_s, memcopy_s_per_gb=copy_s / gb, export_s=export_s,
                   colocated_push_s=push_s, colocated_push_s_per_gb=push_s / gb,
                   colocated_push_vs_memcopy=push_s / copy_s, colocated_profile=median_profile(push_profiles),
                   colocated_full_reload_s=full_s, colocated_full_reload_vs_memcopy=full_s / copy_s,
                   colocated_full_reload_profile=median_profile(full_profiles))
    engine.shutdown()

    if args.server:
        from megatron_rl.runtime.distributed import free_port
        from megatron_rl.rollout.weights.transport import write_safetensors_dir
        from megatron_rl.rollout.engines.vllm_server import VllmServerEngine, VllmServerProcess

        server = VllmServerProcess.start(work / "hf", port=free_port(), log_path=work / "server.log", dtype="float32",
                                         max_model_len=512, cache_dir=work / "cache")
        client = VllmServerEngine(server.url, process=server, staging_dir=work / "staging")

        def files(in_place: bool) -> tuple[list[float], list[dict]]:
            client._rpc("set_in_place_weight_updates", in_place)
            client.update_weights(stream("main"))  # warm-up; with in_place, the push that plans
            times, profiles = [], []
            for _ in range(args.rounds):
                copy_times.append(memcopy())
                started = time.perf_counter()
                client.update_weights(stream("main"))
                times.append(time.perf_counter() - started)
                profiles.append(client._rpc("weight_update_profile")[0])
            return times, profiles

        def write_only() -> tuple[float, float]:
            """The trainer side of a files push alone: write the files, then delete them."""
            started = time.perf_counter()
            write_safetensors_dir(stream("main"), work / "staging" / "write-only", 512 << 20)
            written = time.perf_counter()
            shutil.rmtree(work / "staging" / "write-only")
            return written - started, time.perf_counter() - written

        try:
            server_full_times, server_full_profiles = files(in_place=False)
            server_times, server_profiles = files(in_place=True)
            writes = [write_only() for _ in range(args.rounds)]
            write_s, delete_s = (statistics.median(w[i] for w in writes) for i in (0, 1))
        finally:
            client.shutdown()
        if {p["path"] for p in server_profiles} != {"in_place"}:
            raise SystemExit(f"server pushes did not run in place: {server_profiles[-1]}")
        copy_s = statistics.median(copy_times)  # now over every round of both engines
        server_s, server_full_s = statistics.median(server_times), statistics.median(server_full_times)
        results.update(memcopy_s=copy_s, memcopy_s_per_gb=copy_s / gb,
                       colocated_push_vs_memcopy=push_s / copy_s, colocated_full_reload_vs_memcopy=full_s / copy_s,
                       server_files_push_s=server_s, server_files_push_s_per_gb=server_s / gb,
                       server_push_vs_memcopy=server_s / copy_s, server_profile=median_profile(server_profiles),
                       server_write_files_s=write_s, server_delete_files_s=delete_s,
                       server_full_reload_s=server_full_s,
                       server_full_reload_vs_memcopy=server_full_s / copy_s,
                       server_full_reload_profile=median_profile(server_full_profiles))

    print(f"model: {results['model_parameters'] / 1e6:.1f} M parameters, {gb:.3f} GB pushed (fp32)")
    print(f"generate: {tokens} tokens; raw vLLM {raw_tps:.0f} tok/s, our engine {wrapped_tps:.0f} tok/s "
          f"-> overhead ratio raw/ours {results['overhead_ratio']:.3f}")
    copy_s = results["memcopy_s"]
    print(f"memory copy of the same tensors: {copy_s:.3f} s = {copy_s / gb:.3f} s/GB (median of {len(copy_times)})")
    print(f"bridge export alone: {export_s:.3f} s = {export_s / copy_s:.2f}x memcopy")
    print(f"push colocated, in place: {push_s:.3f} s = {push_s / gb:.2f} s/GB -> {push_s / copy_s:.2f}x memcopy")
    print(f"  where the time goes: {describe(results['colocated_profile'], copy_s)}")
    print(f"push colocated, vLLM full reload: {full_s:.3f} s -> {full_s / copy_s:.2f}x memcopy")
    print(f"  where the time goes: {describe(results['colocated_full_reload_profile'], copy_s)}")
    if "server_files_push_s" in results:
        print(f"push server (files), in place: {server_s:.3f} s = {server_s / gb:.2f} s/GB -> "
              f"{server_s / copy_s:.2f}x memcopy; on the trainer side, writing the files alone "
              f"{write_s:.3f} s ({write_s / copy_s:.2f}x), deleting them {delete_s:.3f} s ({delete_s / copy_s:.2f}x)")
        print(f"  in the server: {describe(results['server_profile'], copy_s)}")
        print(f"push server (files), vLLM full reload: {server_full_s:.3f} s -> {server_full_s / copy_s:.2f}x memcopy")
        print(f"  in the server: {describe(results['server_full_reload_profile'], copy_s)}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    runtime.shutdown()
    shutil.rmtree(work, ignore_errors=True)  # the model, its engine cache and the staging files


def median_profile(profiles: list[dict]) -> dict:
    """Per timing key of the worker's push profiles (rollout/worker/extension.py `_reload`), the median over rounds."""
    return {key: statistics.median(p[key] for p in profiles) for key in profiles[0] if key.endswith("_s")}


def describe(profile: dict, copy_s: float) -> str:
    return ", ".join(f"{key[:-2]} {value:.3f} s ({value / copy_s:.2f}x)" for key, value in profile.items())


if __name__ == "__main__":
    main()
