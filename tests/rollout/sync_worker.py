"""One trainer rank of a weight-sync check against a real vLLM engine, started by torchrun.

    python sync_worker.py --hf HF_DIR --out OUT.json --mode colocated|server [--override k=v ...]

1. Build the Megatron policy (any layout) and load the HF weights.
2. Start vLLM (colocated: from the same HF directory, inside every rank, sharded across them;
   server: the trainer's RolloutClient starts the configured servers with dummy weights and
   pushes the trainer's weights through the configured transport). With several servers every
   check below is made on each engine separately.
3. Generate, train the policy a few optimizer steps on those samples (lr 1e-3, so the weights
   move), and generate again WITHOUT pushing: the engine's logprobs must now disagree with the
   trainer's (this shows the comparison can fail).
4. Push the weights, generate, and compare the engine's logprobs with the trainer's own logprobs
   of the same tokens: the max abs difference is written to OUT.json for the test to bound.
5. Sample at temperature 0.6 and compare the engine's logprobs with the trainer's at 0.6 (and,
   to show the check can fail, with the trainer's untempered ones).
6. Grouping and finish reasons: n samples per prompt in order; a stop token ends a sample with
   "stop", the token budget with "length".
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.algorithms import compute_step_normalizer
from megatron_rl.bridge import load_hf_weights
from megatron_rl.config import load_config
from megatron_rl.model.packing import pack_by_token_budget
from megatron_rl.model.policy import Policy
from megatron_rl.runtime import start_runtime
from megatron_rl.rollout import SamplingParams, hf_weight_stream

PROMPTS = [[3, 17, 99, 250, 7], [42, 311, 5], [480, 64, 128, 2, 77, 199], [13, 401, 9, 333]]
TEMPERATURE = 0.6  # the sampling temperature of the tempered check


def trainer_logprobs(policy: Policy, samples, pad: int, temperature: float = 1.0) -> list[torch.Tensor]:
    """The policy's logprob of every response token of every sample under softmax(logits /
    temperature) (all ranks get them)."""
    sequences = [s.prompt_token_ids + s.response_token_ids for s in samples]
    batches = pack_by_token_budget(sequences, [len(s.prompt_token_ids) for s in samples], 256, pad)
    outputs = policy.logprobs(batches, with_entropy=False, temperature=temperature)
    result: list[torch.Tensor | None] = [None] * len(samples)
    for batch, output in zip(batches, outputs):
        for sample_id, values in zip(batch.sample_ids, batch.response_values(output["logprobs"])):
            result[sample_id] = values.double()
    holder = [result if policy.is_last_stage and _is_first_of_last_stage() else None]
    source = _first_rank_of_last_stage()
    dist.broadcast_object_list(holder, src=source)
    return holder[0]


def _is_first_of_last_stage() -> bool:
    return dist.get_rank() == _first_rank_of_last_stage()


def _first_rank_of_last_stage() -> int:
    return dist.get_world_size() - 1 if _pp() > 1 else 0


def _pp() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size()


def max_diff(samples, reference: list[torch.Tensor]) -> float:
    worst = 0.0
    for sample, ref in zip(samples, reference):
        engine = torch.tensor(sample.logprobs, dtype=torch.float64)
        worst = max(worst, float((engine - ref).abs().max()))
    return worst


def flat(groups):
    return [sample for group in groups for sample in group]


def shm_names() -> dict:
    """The shared-memory name vLLM's CPU build gives the engine's TP group on every rank (the
    name is set whether or not this CPU's kernels use shared memory)."""
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    from vllm.distributed.parallel_state import get_tp_group

    name = _CPUSHMDistributed.make_group_name(get_tp_group().device_communicator)
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, {"ident": os.environ.get("VLLM_DIST_IDENT"), "group": name})
    return {"per_rank": names}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=["colocated", "server"], required=True)
    parser.add_argument("--override", action="append", default=[])
    args = parser.parse_args()
    out = Path(args.out)
    server = ["rollout.mode=server", "rollout.max_model_len=256", "rollout.request_timeout_s=300",
              "rollout.weight_bucket_mb=1"] if args.mode == "server" else []
    config = load_config(None, ["device=cpu", f"model.hf_config={args.hf}", "optimizer.lr=0.001",
                                f"output_dir={out.parent}", *server, *args.override])
    runtime = start_runtime(config)
    pad = config.parallel.tp if config.parallel.uses_sequence_parallel else 1
    policy = Policy(config, runtime)
    load_hf_weights(policy.module, policy.arch, args.hf)
    policy.optimizer.reload_model_params()

    report: dict = {"world": dist.get_world_size()}
    engine = None
    started = time.perf_counter()
    engine = client = None
    if args.mode == "colocated":
        from megatron_rl.rollout.engines.vllm_colocated import VllmColocatedEngine

        engine = VllmColocatedEngine(args.hf, dtype="float32", max_model_len=256, seed=0)
        if dist.get_world_size() > 1:  # one rank: vLLM makes no communicator, nothing is shared
            report["shm_names"] = shm_names()
    else:
        # The trainer's own rollout client: servers started with dummy weights, so the first
        # push (through the configured transport) is what makes them agree with the trainer.
        from megatron_rl.rollout.client import RolloutClient

        client = RolloutClient(config, Path(args.hf), master_addr=runtime.launch.master_addr,
                               local_rank=runtime.launch.local_rank, seed=0)
        report["first_push_tensors"] = client.sync_weights(policy.module, policy.arch)
        report["engines"] = len(client.engines) if client.engines else None
    report["engine_start_s"] = time.perf_counter() - started

    def generate_each(params: SamplingParams) -> list:
        """Every engine's samples for the same prompts (one list per engine), on every rank."""
        if engine is not None:
            return [engine.generate(PROMPTS, params)]
        holder = [[one.generate(PROMPTS, params) for one in client.engines] if client.drives else None]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def generate(params: SamplingParams):
        return generate_each(params)[0]

    def diffs(params: SamplingParams) -> list[float]:
        """Per engine: max |engine logprob - trainer logprob| over its samples."""
        results = []
        for groups in generate_each(params):
            samples = flat(groups)
            results.append(max_diff(samples, trainer_logprobs(policy, samples, pad)))
        return results

    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=7)
    try:
        # Before training, engine and trainer hold the same weights.
        report["initial_diffs"] = diffs(sampling)
        report["initial_diff"] = max(report["initial_diffs"])
        groups = generate(sampling)

        # A few optimizer steps on the engine's own samples (likelihood of the sampled responses).
        samples = flat(groups)
        sequences = [s.prompt_token_ids + s.response_token_ids for s in samples]
        batches = pack_by_token_budget(sequences, [len(s.prompt_token_ids) for s in samples], 64, pad)
        normalizer = compute_step_normalizer([b.loss_mask for b in batches], group=policy.dp_group,
                                             device=runtime.device).num_tokens
        for _ in range(3):
            policy.train_step(batches, lambda lp, ent, b: (-(lp * b.loss_mask[0]).sum() / normalizer, {}))

        report["stale_diffs"] = diffs(sampling)
        report["stale_diff"] = min(report["stale_diffs"])

        started = time.perf_counter()
        if engine is not None:
            report["pushed_tensors"] = engine.update_weights(
                hf_weight_stream(policy.module, policy.arch, destination="all", bucket_bytes=1 << 16))
        else:
            report["pushed_tensors"] = client.sync_weights(policy.module, policy.arch)
        report["push_s"] = time.perf_counter() - started
        report["synced_diffs"] = diffs(sampling)
        if engine is not None:
            # A second push: from the second on, the engine copies into its parameters in place
            # (rollout/worker/inplace_copy.py) instead of vLLM's full reload; it must agree just as well.
            policy.train_step(batches, lambda lp, ent, b: (-(lp * b.loss_mask[0]).sum() / normalizer, {}))
            engine.update_weights(hf_weight_stream(policy.module, policy.arch, destination="all", bucket_bytes=1 << 16))
            report["synced_diffs"] += diffs(sampling)

        # At a sampling temperature the engine returns the logprobs of softmax(logits / T) (the
        # distribution it sampled from) and the trainer computes the same; they must differ from
        # the untempered logprobs, so the comparison can fail.
        started = time.perf_counter()
        tempered = SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=12, seed=11)
        report["tempered_diffs"], report["untempered_diffs"] = [], []
        for groups in generate_each(tempered):
            samples = flat(groups)
            report["tempered_diffs"].append(max_diff(samples, trainer_logprobs(policy, samples, pad, TEMPERATURE)))
            report["untempered_diffs"].append(max_diff(samples, trainer_logprobs(policy, samples, pad)))
        report["tempered_s"] = time.perf_counter() - started

        fresh_groups = generate(sampling)
        fresh = flat(fresh_groups)
        report["synced_diff"] = max(report["synced_diffs"])
        report["fresh_tokens"] = sum(len(s.response_token_ids) for s in fresh)

        # Grouping and order: prompt i's group holds samples (i, 0..n-1), prompts echoed back.
        report["grouping_ok"] = all(
            [(s.prompt_index, s.sample_index) for s in group] == [(i, j) for j in range(sampling.n)]
            and all(s.prompt_token_ids == PROMPTS[i] for s in group)
            for i, group in enumerate(fresh_groups)
        )
        # Finish reasons: greedy decoding, then stop at the third greedy token of prompt 0.
        greedy = generate(SamplingParams(n=1, temperature=0.0, max_tokens=8, seed=1))
        third = greedy[0][0].response_token_ids[2]
        stopped = generate(SamplingParams(n=1, temperature=0.0, max_tokens=8, seed=1, stop_token_ids=(third,)))
        first_stop = greedy[0][0].response_token_ids.index(third)
        report["length_reasons"] = [g[0].finish_reason for g in greedy]
        report["length_lengths"] = [len(g[0].response_token_ids) for g in greedy]
        report["stop_reason"] = stopped[0][0].finish_reason
        report["stop_tokens"] = stopped[0][0].response_token_ids
        report["expected_stop_tokens"] = greedy[0][0].response_token_ids[: first_stop + 1]
    finally:
        if engine is not None:
            engine.shutdown()
        if client is not None:
            client.shutdown()
    if dist.get_rank() == 0:
        out.write_text(json.dumps(report, indent=1))
    dist.barrier()
    runtime.shutdown()


if __name__ == "__main__":
    main()
