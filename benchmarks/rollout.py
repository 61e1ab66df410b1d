"""Rollout engine overhead and weight-push speed, measured against references in the same run.

1. Generation: tokens/s through our engine wrapper (`VllmColocatedEngine.generate`: per-prompt
   seeds, conversion to Samples, grouping checks) vs raw `vllm.LLM.generate` on the SAME engine
   instance, the same prompts and the same seeds, alternating, median of several rounds.
   Reported: overhead ratio = raw tokens/s / wrapper tokens/s (1.00 = no overhead). The two runs
   must produce the same tokens, which the script checks.
2. Weight push: seconds per GB for the full model, Megatron policy -> bridge export -> engine:
   colocated (same-process stream) and, with --server, an HTTP server via safetensors files.
   Reference: the time to copy the same bytes once in memory (`torch.Tensor.copy_`), so the
   ratio says how far the push is from a plain memory copy.

    python benchmarks/rollout.py             # ~2 min on 2 CPU cores
    python benchmarks/rollout.py --server    # adds the HTTP server push (~1 more minute)
    python benchmarks/rollout.py --quick     # smaller, for the test suite
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
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
    from megatron_rl.platform import start_runtime
    from megatron_rl.rollout import SamplingParams, hf_weight_stream
    from megatron_rl.rollout.vllm_colocated import VllmColocatedEngine

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

    from megatron_rl.rollout.vllm_common import to_vllm_sampling

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
    def push_colocated():
        return engine.update_weights(hf_weight_stream(policy.module, policy.arch, destination="all"))

    nbytes = sum(t.numel() * t.element_size() for _, t in hf_weight_stream(policy.module, policy.arch))
    gb = nbytes / 1e9
    push_colocated()  # warm-up
    push_times = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        push_colocated()
        push_times.append(time.perf_counter() - started)
    copy_times = []
    for _ in range(args.rounds):
        sources = [t for _, t in hf_weight_stream(policy.module, policy.arch)]
        targets = [torch.zeros_like(t) for t in sources]  # touched now: the copy then measures bandwidth, not page faults
        started = time.perf_counter()
        for target, source in zip(targets, sources):
            target.copy_(source)
        copy_times.append(time.perf_counter() - started)
        del sources, targets
    push_s = statistics.median(push_times)
    copy_s = statistics.median(copy_times)
    results.update(weights_gb=gb, colocated_push_s=push_s, colocated_push_s_per_gb=push_s / gb,
                   memcopy_s_per_gb=copy_s / gb, colocated_push_vs_memcopy=push_s / copy_s)
    engine.shutdown()

    if args.server:
        from megatron_rl.platform.distributed import free_port
        from megatron_rl.rollout.vllm_server import VllmServerEngine, VllmServerProcess

        server = VllmServerProcess.start(work / "hf", port=free_port(), log_path=work / "server.log", dtype="float32",
                                         max_model_len=512, cache_dir=work / "cache")
        client = VllmServerEngine(server.url, process=server, staging_dir=work / "staging")
        try:
            client.update_weights(hf_weight_stream(policy.module, policy.arch, destination="main"))  # warm-up
            server_times = []
            for _ in range(max(2, args.rounds // 2)):
                started = time.perf_counter()
                client.update_weights(hf_weight_stream(policy.module, policy.arch, destination="main"))
                server_times.append(time.perf_counter() - started)
            server_s = statistics.median(server_times)
            results.update(server_files_push_s=server_s, server_files_push_s_per_gb=server_s / gb,
                           server_push_vs_memcopy=server_s / copy_s)
        finally:
            client.shutdown()

    print(f"model: {results['model_parameters'] / 1e6:.1f} M parameters, {gb:.3f} GB pushed (fp32)")
    print(f"generate: {tokens} tokens; raw vLLM {raw_tps:.0f} tok/s, our engine {wrapped_tps:.0f} tok/s "
          f"-> overhead ratio raw/ours {results['overhead_ratio']:.3f}")
    print(f"push colocated: {push_s:.3f} s = {push_s / gb:.2f} s/GB; memory copy {copy_s / gb:.3f} s/GB "
          f"-> ratio {results['colocated_push_vs_memcopy']:.1f}x")
    if "server_files_push_s" in results:
        print(f"push server (files): {results['server_files_push_s']:.3f} s = "
              f"{results['server_files_push_s_per_gb']:.2f} s/GB -> ratio {results['server_push_vs_memcopy']:.1f}x memcopy")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    runtime.shutdown()


if __name__ == "__main__":
    main()
