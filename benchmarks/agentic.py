"""The agentic task's cost and learning, measured against references in the same run.

1. Prefix reuse: the same model tokens generated as 3 turns with an observation between them
   (each turn a new request carrying the whole history: the multi-turn rollout's pattern) vs in
   one request (the single-turn reference: same prompts, same number of sampled tokens, no
   observations). vLLM's prefix cache serves each turn's history, so the ratio shows what the
   turns themselves cost: request round trips, the observations' prefill, scheduling.
   Reported: multi-turn seconds / single-turn seconds, median of rounds, alternating.
2. The built-in agentic task (`configs/tiny_agent.yaml`) through `megatron-rl train`, colocated
   and (with --server) with `rollout.mode=server rl.max_staleness=1`: held-out accuracy and
   tool-call rate after the warm start and after RL, and per step the time spent in the
   environments, generating and training (medians over the RL steps), from the run's metrics.
   With --openai, the same task once more through the OpenAI-compatible endpoint
   (`rollout.agent`): the agent is a plain OpenAI-client loop that runs the calculator itself
   (megatron_rl/agents/examples/openai_calculator.py); "env" is then the time the trainer waited
   on the agents between engine requests.

    python benchmarks/agentic.py --prefix-only      # ~1 min on 2 CPU cores
    python benchmarks/agentic.py                    # + the colocated learning run (~8 min)
    python benchmarks/agentic.py --server           # + the asynchronous server run (~8 more)
    python benchmarks/agentic.py --rounds 0 --no-colocated --openai   # only the endpoint run (~10 min)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def prefix_reuse(rounds: int, turns: int = 3, turn_tokens: int = 32, prompts: int = 16, n: int = 4) -> dict:
    from dataclasses import replace

    from megatron_rl.agents.chat_format import ChatFormat
    from megatron_rl.agents.rollout import turn_seed
    from megatron_rl.config import load_config
    from megatron_rl.data.chat import to_messages
    from megatron_rl.data.records import PromptRecord
    from megatron_rl.rollout.engine_model import load_engine_tokenizer, write_engine_model_dir
    from megatron_rl.rollout.engines.vllm_colocated import VllmColocatedEngine
    from megatron_rl.rollout.protocol import SamplingParams

    work = Path(tempfile.mkdtemp(prefix="agentic-bench-"))
    write_engine_model_dir(load_config(), work / "model")
    tokenizer = load_engine_tokenizer(work / "model")
    chat = ChatFormat.for_tokenizer(tokenizer)
    engine = VllmColocatedEngine(work / "model", dtype="float32", max_model_len=1024, seed=0,
                                 cache_dir=work / "cache", load_format="dummy")
    # random weights of the tiny model, pushed as the trainer pushes them (generation cost only)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(work / "model"), dtype=torch.float32)
    engine.update_weights(model.state_dict().items())
    records = [PromptRecord(f"{100 + 7 * i}*{300 + 11 * i}=", "0", {}, "bench") for i in range(prompts)]
    first_prompts = [chat.prompt_ids(to_messages(r.prompt)) for r in records]
    # Every turn exactly `turn_tokens` sampled tokens (ignore_eos, no stop ids), so both sides
    # sample the same number of tokens. The multi-turn side is the agent loop's request pattern
    # (agents/rollout.py: one request per turn carrying the whole history, per-turn seeds, the
    # observation rendered once by the chat format); it is driven here directly because the
    # loop itself ends a turn cut by its budget.
    multi = SamplingParams(n=1, temperature=1.0, max_tokens=turn_tokens, seed=3, ignore_eos=True)
    single = SamplingParams(n=n, temperature=1.0, max_tokens=turns * turn_tokens, seed=3, ignore_eos=True)

    def run_multi():
        histories = [list(p) for p in first_prompts for _ in range(n)]
        model_tokens = observation_tokens = 0
        for turn in range(turns):
            seeds = tuple(turn_seed(single.prompt_seed(i // n), i % n, turn) for i in range(len(histories)))
            groups = engine.generate(histories, replace(multi, prompt_seeds=seeds))
            for history, (sample,) in zip(histories, groups):
                history += sample.response_token_ids
                model_tokens += len(sample.response_token_ids)
                if turn < turns - 1:
                    observation = chat.observation_ids([{"role": "tool", "content": f"result {turn}: 12345"}],
                                                       sample.response_token_ids[-1])
                    history += observation
                    observation_tokens += len(observation)
        return model_tokens, observation_tokens

    def run_single():
        groups = engine.generate(first_prompts, single)
        return sum(len(s.response_token_ids) for g in groups for s in g), 0

    run_multi(), run_single()  # warm-up
    times: dict[str, list[float]] = {"multi": [], "single": []}
    counts, observation_tokens = {}, 0
    for _ in range(rounds):
        for label, fn in (("multi", run_multi), ("single", run_single)):
            started = time.perf_counter()
            count, observed = fn()
            times[label].append(time.perf_counter() - started)
            counts[label] = count
            observation_tokens = max(observation_tokens, observed)
    engine.shutdown()
    if counts["multi"] != counts["single"]:
        raise SystemExit(f"the runs sampled different token counts: {counts}")
    multi_s, single_s = statistics.median(times["multi"]), statistics.median(times["single"])
    return {"trajectories": prompts * n, "turns": turns, "model_tokens": counts["multi"],
            "observation_tokens": observation_tokens, "multi_turn_s": multi_s, "single_turn_s": single_s,
            "ratio": multi_s / single_s, "requests_multi_turn": prompts * n * turns}


def learning_run(out: Path, *overrides: str) -> dict:
    command = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(REPO / "configs/tiny_agent.yaml"),
               "--output-dir", str(out), "logging.wandb_mode=disabled", "checkpoint.export_hf=false", *overrides]
    started = time.perf_counter()
    result = subprocess.run(command, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{(result.stdout + result.stderr)[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if r["step"] >= 1]

    def median(key: str) -> float | None:
        values = [r[key] for r in steps if key in r]
        return statistics.median(values) if values else None

    def mean_of(rows: list[dict], key: str) -> float | None:
        values = [r[key] for r in rows if key in r]
        return statistics.fmean(values) if values else None

    # one step's sampled rates are noisy (128 trajectories): the first and last 5 steps, averaged
    first, last = steps[:5], steps[-5:]

    return {"wall_s": wall, "steps": len(steps),
            "eval_accuracy_warm_start": evals[0]["eval/accuracy"], "eval_accuracy_final": evals[-1]["eval/accuracy"],
            "eval_tool_call_rate_warm_start": evals[0].get("eval/tool_call_rate"),
            "eval_tool_call_rate_final": evals[-1].get("eval/tool_call_rate"),
            "train_tool_call_rate_first5": mean_of(first, "agent/tool_call_rate"),
            "train_tool_call_rate_last5": mean_of(last, "agent/tool_call_rate"),
            "train_reward_first5": mean_of(first, "reward/mean"), "train_reward_last5": mean_of(last, "reward/mean"),
            "train_malformed_calls_first5": mean_of(first, "agent/info/malformed_calls"),
            "train_malformed_calls_last5": mean_of(last, "agent/info/malformed_calls"),
            "env_s_per_step": median("time/env_s"), "generate_s_per_step": median("time/generate_s"),
            "wait_rollout_s_per_step": median("time/wait_rollout_s"),
            "train_s_per_step": median("time/train_s"), "logprobs_s_per_step": median("time/logprobs_s"),
            "step_s": median("time/step_s"), "turns_mean": median("agent/turns_mean"),
            "masked_token_share": median("agent/masked_token_share"),
            "eval_curve": [(r["step"], r["eval/accuracy"], r.get("eval/tool_call_rate")) for r in evals]}


def fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefix-only", action="store_true", help="only the prefix-reuse measurement")
    parser.add_argument("--server", action="store_true", help="also the asynchronous server run")
    parser.add_argument("--openai", action="store_true",
                        help="also the run through the OpenAI-compatible endpoint (rollout.agent: the plain "
                             "OpenAI-client agent of megatron_rl/agents/examples/openai_calculator.py)")
    parser.add_argument("--no-colocated", action="store_true", help="skip the colocated environment run")
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args()

    results = {}
    if args.rounds:
        results["prefix_reuse"] = p = prefix_reuse(args.rounds)
        print(f"prefix reuse: {p['trajectories']} trajectories x {p['turns']} turns, {p['model_tokens']} model "
              f"tokens (+{p['observation_tokens']} observation tokens): multi-turn {p['multi_turn_s']:.2f} s vs the "
              f"same tokens single-turn {p['single_turn_s']:.2f} s, ratio {p['ratio']:.2f}")
    if not args.prefix_only:
        work = Path(tempfile.mkdtemp(prefix="agentic-runs-"))
        runs = {} if args.no_colocated else {"colocated": ()}
        if args.server:
            runs["server_staleness_1"] = ("rollout.mode=server", "rollout.weight_transport=collective",
                                          "rl.max_staleness=1")
        if args.openai:
            runs["openai_endpoint"] = ("rollout.agent=megatron_rl.agents.examples.openai_calculator:solve",)
        for name, overrides in runs.items():
            r = learning_run(work / name, *overrides)
            results[name] = r
            print(f"{name}: held-out accuracy {r['eval_accuracy_warm_start']:.3f} after the warm start -> "
                  f"{r['eval_accuracy_final']:.3f} after {r['steps']} RL steps (+"
                  f"{r['eval_accuracy_final'] - r['eval_accuracy_warm_start']:.3f}; greedy tool-call rate "
                  f"{r['eval_tool_call_rate_warm_start']} -> {r['eval_tool_call_rate_final']}); sampled, first 5 -> "
                  f"last 5 steps: tool-call rate {r['train_tool_call_rate_first5']:.3f} -> "
                  f"{r['train_tool_call_rate_last5']:.3f}, reward {r['train_reward_first5']:.3f} -> "
                  f"{r['train_reward_last5']:.3f}, malformed calls per trajectory "
                  f"{r['train_malformed_calls_first5']:.2f} -> {r['train_malformed_calls_last5']:.2f}; median per "
                  f"step: env {fmt(r['env_s_per_step'])}, generate {fmt(r['generate_s_per_step'])}, wait for rollouts "
                  f"{fmt(r['wait_rollout_s_per_step'])}, logprobs {fmt(r['logprobs_s_per_step'])}, train "
                  f"{fmt(r['train_s_per_step'])}, step {fmt(r['step_s'])} s; wall {r['wall_s']:.0f} s")
        if "colocated" in results and "openai_endpoint" in results:
            ours, reference = results["openai_endpoint"], results["colocated"]
            rollout = {name: (r["env_s_per_step"] or 0.0) + (r["generate_s_per_step"] or 0.0)
                       for name, r in (("ours", ours), ("reference", reference))}
            results["openai_vs_environment"] = {"rollout_s_ratio": rollout["ours"] / rollout["reference"],
                                                "step_s_ratio": ours["step_s"] / reference["step_s"]}
            print(f"endpoint vs environment loop, same task and invocation: rollout (generate + env) per step "
                  f"{rollout['ours']:.2f} s vs {rollout['reference']:.2f} s, ratio "
                  f"{results['openai_vs_environment']['rollout_s_ratio']:.2f}; step ratio "
                  f"{results['openai_vs_environment']['step_s_ratio']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
