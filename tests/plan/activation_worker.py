"""One real training micro-batch on CPU: the activations it saved and its peak memory, against
the planner's estimate (megatron_rl/plan/activations.py). Run by test_activation_estimate.py and
benchmarks/activation_memory.py in a process of their own (the runtime is process-wide).

    python activation_worker.py OUT.json TOKENS CASE [CASE ...]     CASE: HIDDEN,LAYERS,RECOMPUTE,FAMILY

OUT.json: a list, one result per case, measured one after the other in this process (one import of
torch and Megatron-Core for all of them). Each case starts the runtime, builds its model, warms, measures
and shuts the runtime down; before the next case its model, optimizer and runtime are garbage and
glibc hands their freed heap back to the kernel (malloc_trim), so what the next case's peak is taken
above holds no free memory of an earlier case that its step could reuse unseen: every block of 64 KiB
or more was its own mapping, unmapped when freed, and the small blocks' heap is trimmed. What an
earlier case leaves alive is in the resident set before and at the peak alike, not in the difference.

The model is FAMILY's (qwen3-moe: MoE layers with GQA attention; deepseek-v3: multi-latent
attention, a dense first layer, then MoE layers with a shared expert) at the given width and depth,
one process, fp32.
Measured:
  saved    bytes of the distinct storages the forward saved for the backward (autograd's
           saved-tensor hooks; parameters and their gradient buffers left out): what the
           estimate models
  peak     the peak resident memory of the forward + backward above the state before it
           (VmHWM after clear_refs, benchmarks/peak_memory.py), with the gradients going into
           buffers allocated before: what a user sees
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from peak_memory import PeakMemory  # noqa: E402


def model_config(directory: Path, hidden: int, layers: int, family: str = "qwen3-moe") -> Path:
    from megatron_rl.model.hf_config import load_hf_config

    raw, _ = load_hf_config(f"tiny-{family}")
    raw.update(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=2 * hidden,
               moe_intermediate_size=hidden // 2, vocab_size=8000, tie_word_embeddings=False)
    if family == "deepseek-v3":  # latent ranks and head widths grow with the model, as DeepSeek-V3's
        raw.update(q_lora_rank=hidden // 2, kv_lora_rank=hidden // 2, qk_nope_head_dim=hidden // 8,
                   qk_rope_head_dim=hidden // 16, v_head_dim=hidden // 8)
    else:
        raw.update(head_dim=hidden // raw["num_attention_heads"])
    raw.pop("mlp_only_layers", None)
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


def measure(out: Path, hidden: int, layers: int, tokens: int, recompute: str, family: str = "qwen3-moe") -> dict:
    from megatron_rl.config import load_config
    from megatron_rl.model.packing import pack
    from megatron_rl.model.policy import Policy
    from megatron_rl.plan.activations import ActivationInputs, stage_bytes
    from megatron_rl.plan.meta_model import layer_kinds
    from megatron_rl.runtime import start_runtime

    directory = out.parent / f"model-{family}-{hidden}x{layers}"
    directory.mkdir(exist_ok=True)
    model_config(directory, hidden, layers, family)
    config = load_config(None, ["device=cpu", f"model.hf_config={directory}", "model.precision=fp32",
                                f"model.recompute={recompute}", f"micro_batch_tokens={tokens}"])
    runtime = start_runtime(config)
    policy = Policy(config, runtime)
    generator = torch.Generator().manual_seed(0)
    lengths = [tokens // 4] * 4  # four samples packed into one micro-batch of `tokens`
    samples = [torch.randint(0, policy.arch.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    batch = pack(samples, [8] * len(samples), pad_to_multiple=policy.pad_to_multiple)

    def loss_fn(logprobs, entropy, batch):
        mask = batch.loss_mask.to(logprobs.device)
        return -(logprobs * mask).sum() / mask.sum(), {}

    policy.train_step([batch], loss_fn)  # warm: buffers, optimizer state, allocator pools

    # Parameters and the DDP buffers they and their gradients live in are training state, not
    # activations (a linear layer saves its weight for the backward).
    weights = {p.untyped_storage().data_ptr() for p in policy.module.parameters()}
    for buffer in policy.model.buffers + policy.model.expert_parallel_buffers:
        weights |= {t.untyped_storage().data_ptr() for t in (buffer.param_data, buffer.grad_data) if t is not None}
    saved: dict[int, int] = {}

    def pack_hook(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    peak = PeakMemory()
    peak.start()
    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda tensor: tensor):
        policy.forward_backward([batch], loss_fn)
    peak_bytes = peak.peak_bytes()
    arch = policy.arch
    x = ActivationInputs(tokens=batch.num_tokens, tp=1, ep=1, etp=1, sequence_parallel=False, itemsize=4,
                         recompute=recompute, logprob_chunk_tokens=config.logprob_chunk_tokens,
                         vocab_rows=policy.module.embedding.word_embeddings.weight.shape[0], attention="cpu")
    estimate = stage_bytes(arch, layer_kinds(arch), x, first=True, last=True)
    runtime.shutdown()
    return {"family": family, "hidden": hidden, "layers": layers, "tokens": batch.num_tokens, "recompute": recompute,
            "parameters": sum(p.numel() for p in policy.module.parameters()),
            "saved_bytes": sum(saved.values()), "peak_bytes": peak_bytes, "peak_method": peak.method,
            "estimate_bytes": estimate}


def release_freed_memory() -> None:
    """Collect the last case's objects and return glibc's free heap pages to the kernel."""
    gc.collect()
    ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    tokens = int(sys.argv[2])
    results = []
    for case in sys.argv[3:]:
        hidden, layers, recompute, family = case.split(",")
        release_freed_memory()
        results.append(measure(out, int(hidden), int(layers), tokens, recompute, family))
    out.write_text(json.dumps(results))
