"""One family's engine-vs-transformers check against a real vLLM engine (the CPU build), in its own process.

    python families_worker.py --family deepseek_v3|glm4_moe --root DIR --out OUT.json

1. Three tiny random models of the same config (seeds 0, 1, 2) are made with transformers and
   saved with save_pretrained (fp32, HF's per-expert on-disk names), norms away from 1, biases
   and the routers' `e_score_correction_bias` away from 0, each model with its own values.
2. The colocated engine starts from model 0; every tensor of model 1 is then pushed through
   `update_weights_from_stream` (the colocated transport), and every tensor of model 2 through
   `update_weights_from_files` (the server's transport) from model 2's safetensors files.
3. After the load and after each push: the engine's prompt logprobs (prefill) and the logprobs
   of 6 sampled tokens per prompt (decode: vLLM's MLA decodes with weights derived from
   kv_b_proj, prefill does not) are compared with transformers' logprobs of the same tokens
   under the model the engine should now hold, and under the one it held before (which must
   disagree, or the comparison proves nothing).
4. The correction bias matters: transformers' logprobs of model 1 with model 0's bias must differ
   from model 1's, so an engine that kept a stale bias would fail step 3.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from vocab_tokenizer import write_tokenizer  # noqa: E402

VOCAB = 500
PROMPTS = [[3, 17, 99, 250, 7, 44, 12], [42, 311, 5, 9], [480, 64, 128, 2, 77, 199, 300, 301, 5]]
DECODE_TOKENS = 6

# vLLM's CPU MLA backend takes only a 576-wide latent cache: kv_lora_rank 512 + qk_rope_head_dim 64.
# Everything else is tiny. DeepSeek: q LoRA (as published), plain RoPE (the path vLLM's CPU
# rotary kernel got wrong, see megatron_rl/rollout/worker/extension.py), a dense first layer, then
# MoE layers with a shared expert and sigmoid routing over 2 groups (1 chosen). vLLM reads
# topk_method/scoring_func from config.json (transformers hard-codes them), as the published
# configs carry them. GLM-4.5: partial rotary 0.5, q/k/v bias, qk-norm, shared expert, sigmoid
# routing with correction bias.
CONFIGS = {
    "deepseek_v3": dict(
        model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=VOCAB, hidden_size=64,
        intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=32,
        qk_rope_head_dim=64, v_head_dim=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, topk_method="noaux_tc",
        scoring_func="sigmoid", rope_interleave=True, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    "glm4_moe": dict(
        model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], vocab_size=VOCAB, hidden_size=64,
        intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.5, attention_bias=True,
        use_qk_norm=True, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        routed_scaling_factor=1.5, norm_topk_prob=True, max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}


def make_model(raw: dict, directory: Path, seed: int):
    """As tests/bridge/test_bridge.py make_hf_model, plus a non-zero correction bias (a buffer there)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    model = AutoModelForCausalLM.from_config(config).float()
    biases = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.2 * torch.randn_like(param) if "norm" in name else 0.08 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn_like(buffer))
                biases += 1
    assert biases > 0, "the config built no router correction bias"
    model.save_pretrained(directory)
    write_tokenizer(directory, raw["vocab_size"])
    return model.eval()


def read_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def reference(model, sequence: list[int]) -> torch.Tensor:
    """transformers' logprob of every token of `sequence` after the first."""
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([sequence])).logits[0].double(), dim=-1)
    return logprobs[:-1].gather(1, torch.tensor(sequence[1:])[:, None])[:, 0]


def engine_logprobs(engine, seed: int) -> list[tuple[list[int], torch.Tensor, int]]:
    """(prompt + sampled tokens, engine logprob of every token after the first, prompt length)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(max_tokens=DECODE_TOKENS, temperature=1.0, seed=seed + index, logprobs=0,
                             prompt_logprobs=0) for index in range(len(PROMPTS))]
    outputs = engine._llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    result = []
    for prompt, output in zip(PROMPTS, outputs):
        completion = output.outputs[0]
        prompt_lp = [output.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
        decode_lp = [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)]
        assert len(decode_lp) == DECODE_TOKENS
        result.append((prompt + list(completion.token_ids), torch.tensor(prompt_lp + decode_lp, dtype=torch.float64),
                       len(prompt)))
    return result


def diffs(samples, model) -> dict[str, float]:
    prefill = decode = 0.0
    for sequence, engine, prompt_len in samples:
        delta = (engine - reference(model, sequence)).abs()
        prefill = max(prefill, float(delta[: prompt_len - 1].max()))
        decode = max(decode, float(delta[prompt_len - 1:].max()))
    return {"prefill": prefill, "decode": decode}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", choices=sorted(CONFIGS), required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    root = Path(args.root)
    raw = CONFIGS[args.family]
    dirs = [root / f"model{seed}" for seed in range(3)]
    models = [make_model(raw, directory, seed) for seed, directory in enumerate(dirs)]
    checkpoints = [read_checkpoint(directory) for directory in dirs]
    report: dict = {"family": args.family, "tensors": len(checkpoints[0]),
                    "per_expert_names": any(".experts.0.gate_proj.weight" in name for name in checkpoints[0]),
                    "bias_tensors": sorted(n for n in checkpoints[0] if n.endswith("e_score_correction_bias"))}

    from megatron_rl.rollout.engines.vllm_colocated import VllmColocatedEngine

    engine = VllmColocatedEngine(dirs[0], dtype="float32", max_model_len=256, seed=0)
    try:
        samples = engine_logprobs(engine, seed=0)
        report["initial"] = diffs(samples, models[0])

        report["pushed_stream"] = engine.update_weights(iter(checkpoints[1].items()))
        samples = engine_logprobs(engine, seed=100)
        report["after_stream"] = diffs(samples, models[1])
        report["stale_after_stream"] = diffs(samples, models[0])

        # A stale correction bias would show: model 1 with model 0's bias scores these tokens differently.
        biases = {n: b for n, b in models[1].named_buffers() if n.endswith("e_score_correction_bias")}
        with torch.no_grad():
            for name, buffer in biases.items():
                buffer.copy_(checkpoints[0][name])
            report["bias_effect"] = diffs(samples, models[1])
            for name, buffer in biases.items():
                buffer.copy_(checkpoints[1][name])

        files = sorted(str(file) for file in dirs[2].glob("*.safetensors"))
        (report["pushed_files"],) = engine._llm.collective_rpc("update_weights_from_files", args=(json.dumps(files),))
        engine._llm.reset_prefix_cache()
        samples = engine_logprobs(engine, seed=200)
        report["after_files"] = diffs(samples, models[2])
        report["stale_after_files"] = diffs(samples, models[1])
    finally:
        engine.shutdown()
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
