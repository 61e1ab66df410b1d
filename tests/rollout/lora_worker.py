"""vLLM's native LoRA as the adapter-only push uses it, on one dense family, in its own process.

    python lora_worker.py --family qwen3|llama --targets qkv,proj[,fc1,fc2] --root DIR --out OUT.json

1. A tiny random model of the family's preset (megatron_rl/model/presets) is made with
   transformers and saved; the colocated engine starts from it with the push's LoRA arguments
   (rollout/engines/vllm_lora.py engine_lora_args).
2. Two adapters with PEFT's names, random nonzero A and B on every module of the targets, are
   pushed one after the other (`update_adapters`: in memory, a fresh id each). After each, the
   engine's logprobs (prompt and 6 sampled tokens; one prompt longer than a KV block, asked
   without prompt logprobs, so a cached prefix of the previous adapter would be reused if the push
   let it) are compared with
   transformers' logprobs of the merged model W + (alpha / rank) B A, and with the previous one's.
3. The pushed tensors are unchanged by the push (vLLM scales B in place when given its own).
4. An adapter on a module outside the engine's targets is refused by the engine (by name, before
   the workers see it) and, given to the workers directly, by them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from vocab_tokenizer import write_tokenizer  # noqa: E402

RANK, ALPHA = 8, 16.0
DECODE_TOKENS = 6
PEFT_MODULES = {"qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")), "proj": ("self_attn", ("o_proj",)),
                "fc1": ("mlp", ("gate_proj", "up_proj")), "fc2": ("mlp", ("down_proj",))}


def prompts(vocab: int) -> list[list[int]]:
    long = [(7 * i + 3) % (vocab - 3) + 3 for i in range(200)]  # > one KV block (128 tokens on CPU)
    return [[3, 17, 99, 250, 7, 44, 12], [42, 311, 5, 9], long]


def make_model(family: str, directory: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_rl.model import presets

    raw = json.loads((Path(presets.__file__).parent / f"tiny-{family}.json").read_text())
    torch.manual_seed(0)
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.2 * torch.randn_like(param) if "norm" in name else 0.08 * torch.randn_like(param))
    model.save_pretrained(directory)
    write_tokenizer(directory, config.vocab_size)
    return model.eval()


def random_adapter(model, targets: list[str], seed: int, modules=None) -> dict[str, torch.Tensor]:
    """PEFT-named lora_A / lora_B on every module of `targets` (or the (parent, leaf) `modules`)."""
    generator = torch.Generator().manual_seed(seed)
    wanted = modules or [(parent, leaf) for t in targets for parent, leaves in [PEFT_MODULES[t]] for leaf in leaves]
    tensors = {}
    for index, layer in enumerate(model.model.layers):
        for parent, leaf in wanted:
            linear = getattr(getattr(layer, parent), leaf)
            name = f"base_model.model.model.layers.{index}.{parent}.{leaf}"
            tensors[f"{name}.lora_A.weight"] = 0.15 * torch.randn(RANK, linear.in_features, generator=generator)
            tensors[f"{name}.lora_B.weight"] = 0.15 * torch.randn(linear.out_features, RANK, generator=generator)
    return tensors


def merged_model(model, tensors: dict[str, torch.Tensor]):
    """A float64 copy of `model` with W + (alpha / rank) B A on every adapted module."""
    import copy

    merged = copy.deepcopy(model).double()
    weights = dict(merged.named_parameters())
    with torch.no_grad():
        for key, a in tensors.items():
            if key.endswith(".lora_A.weight"):
                module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = tensors[f"base_model.model.{module}.lora_B.weight"]
                weights[f"{module}.weight"] += (ALPHA / RANK) * (b.double() @ a.double())
    return merged


def engine_logprobs(engine, all_prompts, seed: int):
    """(prompt + sampled tokens, the engine's logprobs, the position of the first). Prompt logprobs
    for the short prompts; the long one asks for none, as rollouts do, so that its prefix may come
    from the prefix cache (vLLM reads no cached prefix for a request with prompt logprobs)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(max_tokens=DECODE_TOKENS, temperature=1.0, seed=seed + index, logprobs=0,
                             prompt_logprobs=0 if len(prompt) < 128 else None)
              for index, prompt in enumerate(all_prompts)]
    outputs = engine._llm.generate([TokensPrompt(prompt_token_ids=p) for p in all_prompts], params, use_tqdm=False,
                                   lora_request=engine._lora_request)
    result = []
    for prompt, output in zip(all_prompts, outputs):
        completion = output.outputs[0]
        prompt_lp = ([output.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
                     if output.prompt_logprobs else [])
        decode_lp = [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)]
        first = len(prompt) - 1 - len(prompt_lp)
        result.append((prompt + list(completion.token_ids), torch.tensor(prompt_lp + decode_lp, dtype=torch.float64),
                       first))
    return result


def max_diff(samples, model) -> float:
    worst = 0.0
    for sequence, engine, first in samples:
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([sequence])).logits[0].double(), dim=-1)
        reference = logprobs[:-1].gather(1, torch.tensor(sequence[1:])[:, None])[:, 0][first:]
        worst = max(worst, float((engine - reference).abs().max()))
    return worst


def refusal(call) -> str | None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the message is the report
        return f"{type(exc).__name__}: {exc}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", required=True)
    parser.add_argument("--targets", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    targets = args.targets.split(",")
    model = make_model(args.family, Path(args.root) / "base")
    all_prompts = prompts(model.config.vocab_size)

    from megatron_rl.rollout.engines.vllm_colocated import VllmColocatedEngine
    from megatron_rl.rollout.engines.vllm_lora import adapter_config, engine_lora_args

    report: dict = {"family": args.family, "targets": targets}
    engine = VllmColocatedEngine(Path(args.root) / "base", dtype="float32", max_model_len=256, seed=0,
                                 lora=engine_lora_args(targets, RANK))
    try:
        merged_before = merged_model(model, {})
        for push in (1, 2):
            tensors = random_adapter(model, targets, seed=push)
            before = {name: tensor.clone() for name, tensor in tensors.items()}
            report[f"push{push}_tensors"] = engine.update_adapters(tensors, adapter_config(tensors, RANK, ALPHA))
            report[f"push{push}_caller_tensors_unchanged"] = all(before[n].equal(t) for n, t in tensors.items())
            samples = engine_logprobs(engine, all_prompts, seed=100 * push)
            merged = merged_model(model, tensors)
            report[f"push{push}_vs_merged"] = max_diff(samples, merged)
            report[f"push{push}_vs_previous"] = max_diff(samples, merged_before)
            merged_before = merged
        # an adapter on a module the engine does not adapt: refused, not dropped
        outside = [(parent, leaf) for target, (parent, leaves) in PEFT_MODULES.items() if target not in targets
                   for leaf in leaves]
        if outside:
            stray = {**tensors, **random_adapter(model, targets, seed=9, modules=outside[:1])}
            report["outside_module"] = outside[0][1]
            report["refused_by_engine"] = refusal(lambda: engine.update_adapters(stray, adapter_config(stray, RANK, ALPHA)))
            report["refused_by_workers"] = refusal(lambda: engine._llm.collective_rpc(
                "load_lora_adapter", args=(99, stray, adapter_config(stray, RANK, ALPHA))))
            samples = engine_logprobs(engine, all_prompts, seed=300)
            report["after_refusals_vs_merged"] = max_diff(samples, merged_before)  # the last good adapter still served
    finally:
        engine.shutdown()
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
