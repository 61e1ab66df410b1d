"""Single-process checks that need a live Megatron runtime; run in a subprocess by the tests so
the CPU compatibility layer and Megatron's global state never enter the pytest process.

    python policy_worker.py packing  HF_CONFIG OUT.json
    python policy_worker.py params   HF_CONFIG OUT.json
    python policy_worker.py nonfinite HF_CONFIG OUT.json
"""

import json
import sys

import torch


def start(hf_config: str, *overrides: str):
    from megatron_rl.config import load_config
    from megatron_rl.model.policy import Policy
    from megatron_rl.runtime import start_runtime
    from megatron_rl.runtime.cpu import megatron_patches as cpu_compat

    assert not cpu_compat.is_active(), "the CPU layer must not be active before the runtime starts"
    config = load_config(None, ["device=cpu", f"model.hf_config={hf_config}", *overrides])
    runtime = start_runtime(config)
    return Policy(config, runtime), runtime


def packing(hf_config: str) -> dict:
    """Logprobs of samples packed together must equal each sample computed alone."""
    from megatron_rl.model.packing import pack

    policy, runtime = start(hf_config)
    generator = torch.Generator().manual_seed(0)
    lengths, prompts = [17, 5, 33, 9], [4, 2, 10, 1]
    samples = [torch.randint(0, policy.arch.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    together = policy.logprobs([pack(samples, prompts, pad_to_multiple=8)])[0]
    packed = [v for v in pack(samples, prompts, pad_to_multiple=8).response_values(together["logprobs"])]
    packed_entropy = pack(samples, prompts, pad_to_multiple=8).response_values(together["entropy"])
    alone, alone_entropy = [], []
    for tokens, prompt in zip(samples, prompts):
        batch = pack([tokens], [prompt])
        out = policy.logprobs([batch])[0]
        alone.append(batch.response_values(out["logprobs"])[0])
        alone_entropy.append(batch.response_values(out["entropy"])[0])
    from megatron_rl.runtime.cpu import megatron_patches as cpu_compat

    result = {
        "logprob_diff": max((a - b).abs().max().item() for a, b in zip(packed, alone)),
        "entropy_diff": max((a - b).abs().max().item() for a, b in zip(packed_entropy, alone_entropy)),
        "response_lengths": [len(v) for v in packed],
        "mean_logprob": torch.cat(alone).mean().item(),
        "cpu_layer_active": cpu_compat.is_active(),
        "current_device": str(torch.cuda.current_device()),
    }
    runtime.shutdown()
    return result


def params(hf_config: str) -> dict:
    """Parameter count of the Megatron model vs the same config in transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_rl.model.builder import padded_vocab_size
    from megatron_rl.model.hf_config import load_hf_config

    policy, runtime = start(hf_config)
    megatron = sum(p.numel() for p in policy.module.parameters())
    raw, _ = load_hf_config(hf_config)
    hf_config_obj = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    hf = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf_config_obj).parameters())
    arch = policy.arch
    padding = padded_vocab_size(arch.vocab_size, 128, 1) - arch.vocab_size
    padded_rows = padding * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
    runtime.shutdown()
    return {"megatron": megatron, "megatron_without_padding": megatron - padded_rows, "hf": hf}


def nonfinite(hf_config: str) -> dict:
    """Policy.train_step on a NaN gradient (skipped, weights untouched), then a good one, then an
    update that overflows the weights (lr 1e30, set past the config's own check)."""
    from megatron_rl.model.packing import pack

    policy, runtime = start(hf_config)
    generator = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, policy.arch.vocab_size, (n,), generator=generator).tolist() for n in (12, 9)]
    batches = [pack(samples, [4, 3], pad_to_multiple=8)]

    def loss_with(scale: float):
        def loss_fn(logprobs, entropy, batch):
            mask = batch.loss_mask.to(logprobs.device)
            return -(logprobs * mask).sum() / mask.sum() * scale, {}
        return loss_fn

    def weights():
        return torch.cat([p.detach().float().flatten().clone() for p in policy.module.parameters()])

    def norm(values):
        return float(values.double().norm())

    before = weights()
    start_norm = policy.weight_norm()
    nan_step = policy.train_step(batches, loss_with(float("nan")))
    after_nan = weights()
    good_step = policy.train_step(batches, loss_with(1.0))
    after_good = weights()
    for group in policy.optimizer.param_groups:
        group["max_lr"] = group["min_lr"] = 1e30  # the scheduler re-applies its rate each step
    blown = policy.train_step(batches, loss_with(1.0), lr=1e30)
    result = {
        "nan_step": {"updated": nan_step.updated, "grad_norm": repr(nan_step.grad_norm),
                     "weights_finite": nan_step.weights_finite},
        "nan_step_changed_weights": int((after_nan != before).sum()),
        "good_step": {"updated": good_step.updated, "grad_norm": good_step.grad_norm,
                      "weights_finite": good_step.weights_finite},
        "good_step_changed_weights": int((after_good != after_nan).sum()),
        # the weight norm the guard compares: before any update, and the one each update reports
        "norms": {"start": start_norm, "start_of_weights": norm(before), "good_step": good_step.weight_norm,
                  "good_step_of_weights": norm(after_good), "nan_step": repr(nan_step.weight_norm),
                  "blown_step": repr(blown.weight_norm)},
        "good_step_lr": good_step.lr,
        "blown_step": {"updated": blown.updated, "weights_finite": blown.weights_finite},
        "blown_max_weight": float(weights().abs().max()),
    }
    runtime.shutdown()
    return result


if __name__ == "__main__":
    mode, hf_config, out = sys.argv[1:4]
    result = {"packing": packing, "params": params, "nonfinite": nonfinite}[mode](hf_config)
    with open(out, "w") as handle:
        json.dump(result, handle)
