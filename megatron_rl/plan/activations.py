"""Activation memory of one micro-batch on one rank: an estimate, term by term.

Activations are what the forward saves for the backward. They depend on the kernels, so unlike
the training state (plan/state_bytes.py) they are estimated, not counted: each term below is a
tensor the forward of our layer spec keeps alive until the backward, sized from the model's
shape and the parallel layout, for a packed micro-batch of T tokens (model.micro_batch_tokens).
With sequence parallelism (tp > 1) the tensors outside attention and the MLP hold T / tp tokens
per rank; inside them heads, MLP width and experts are split instead. e is the activation element
size (2 in bf16, 4 in fp32).

Per attention block (GQA: a query heads, g KV heads of width d, over tp):
  e*s*h                       the input norm's input (s = T/tp with sequence parallelism, else T)
  e*s*h                       the QKV projection's input (Megatron keeps the local shard under SP)
  e*T*(a+2g)*d/tp             the fused QKV output (the value is a view of it, kept by attention)
  e*T*(a+g)*d/tp              query and key after RoPE (new tensors)
  e*T*a*d/tp + 4*T*a/tp       flash attention's output and its fp32 log-sum-exp (the output is also
                              the output projection's input)
Multi-latent attention: the same, with the latent projections' outputs (q_lora_rank, kv_lora_rank +
rope dims, normed: twice each) and query/key width qk_head_dim, value width v_head_dim.
Per dense MLP (width f):  e*s*h (norm input) + e*s*h (fc1 input) + e*T*2f/tp (fc1 output, the
  SwiGLU input) + e*T*f/tp (fc2 input).
Per MoE MLP (E experts, top-k, width f_e over etp; R = k*T routed token copies per rank with
balanced routing: T/tp local tokens, gathered over tp, spread over ep ranks holding E/ep experts
each, k copies): e*s*h (norm input) + 4*T*E/tp*2 (fp32 router scores and probabilities) +
  e*R*h*2 (permuted tokens in, expert outputs out) + e*R*(h + 2f_e/etp + f_e/etp) (each expert's fc1
  input, SwiGLU input, fc2 input), plus a shared-expert MLP as a dense one.
First stage: the embedding output, e*s*h. Last stage: the final norm's input and the output
  layer's input (e*s*h each), the vocabulary-parallel logits e*T*V/tp, and the loss's fp32 chunk
  buffers 2*4*C*V/tp (C = logprob_chunk_tokens).
Recompute (model.recompute: full): each layer keeps only its input (e*s*h); the peak is then the
  larger of the loss's backward (the last stage's terms above) and one layer's recomputed forward.

What is left out: tensors below 1% (norm statistics, routing indices, RoPE tables) and allocator
fragmentation. Measured error against real steps: benchmarks/results/activation_memory_cpu.md
(tests/plan/test_activation_estimate.py keeps it in CI).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ActivationInputs:
    tokens: int  # tokens per micro-batch (packed)
    tp: int
    ep: int
    etp: int
    sequence_parallel: bool
    itemsize: int  # activation element size: 2 (bf16) or 4 (fp32)
    recompute: str = "none"  # "none" or "full"
    logprob_chunk_tokens: int = 1024
    vocab_rows: int | None = None  # the padded vocabulary (None: the model's)
    # "gpu": Transformer Engine's fused attention; "cpu": the local spec's packed attention, which
    # gathers q, k, v into padded length buckets and copies the output back (two more copies)
    attention: str = "gpu"


def _local_tokens(x: ActivationInputs) -> int:
    return x.tokens // x.tp if x.sequence_parallel else x.tokens


def norm_bytes(hidden: int, x: ActivationInputs) -> int:
    """An RMSNorm keeps its input and its normalized input (for the weight's gradient)."""
    return 2 * x.itemsize * _local_tokens(x) * hidden


def attention_bytes(arch, x: ActivationInputs) -> int:
    e, T, tp = x.itemsize, x.tokens, x.tp
    a = arch.num_attention_heads
    if arch.mla is None:
        g, d = arch.num_key_value_heads, arch.head_dim
        qkv = e * T * (a + 2 * g) * d // tp
        rope = e * T * (a + g) * d // tp
        out = e * T * a * d // tp
    else:
        mla = arch.mla
        latent = (mla.q_lora_rank or 0) + mla.kv_lora_rank + mla.qk_rope_head_dim
        # the latent down-projections' outputs and their norms (replicated over tp), then the
        # up-projections' query, key and value
        qkv = 2 * e * T * latent + e * T * a * (2 * mla.qk_head_dim + mla.v_head_dim) // tp
        rope = e * T * a * 2 * mla.qk_head_dim // tp
        out = e * T * a * mla.v_head_dim // tp
    copies = qkv - (2 * e * T * latent if arch.mla is not None else 0) + out if x.attention == "cpu" else 0
    projection_input = e * _local_tokens(x) * arch.hidden_size
    return norm_bytes(arch.hidden_size, x) + projection_input + qkv + rope + out + 4 * T * a // tp + copies


def dense_mlp_bytes(hidden: int, width: int, x: ActivationInputs, *, with_norm: bool = True) -> int:
    """Norm, fc1's input, fc1's output (the SwiGLU input), SiLU's output and fc2's input."""
    e, T, tp = x.itemsize, x.tokens, x.tp
    return (norm_bytes(hidden, x) if with_norm else 0) + e * _local_tokens(x) * hidden + e * T * 4 * width // tp


def moe_mlp_bytes(arch, x: ActivationInputs) -> int:
    """Norm, fp32 router scores and probabilities, the routed token copies into the experts and
    their probability-weighted outputs, each expert's SwiGLU, and the combined output."""
    e, T, tp = x.itemsize, x.tokens, x.tp
    h, f = arch.hidden_size, arch.moe_ffn_hidden_size
    routed = arch.moe_top_k * T // tp * x.etp  # token copies on this rank (balanced routing)
    total = norm_bytes(h, x) + 2 * 4 * T * arch.num_experts // tp
    total += e * routed * 2 * h + e * routed * 4 * f // x.etp + e * _local_tokens(x) * h
    if arch.moe_shared_ffn_hidden_size:
        total += dense_mlp_bytes(h, arch.moe_shared_ffn_hidden_size, x, with_norm=False)
    return total


def layer_bytes(arch, kind: str, x: ActivationInputs) -> int:
    mlp = moe_mlp_bytes(arch, x) if kind == "moe" else dense_mlp_bytes(arch.hidden_size, arch.ffn_hidden_size, x)
    return attention_bytes(arch, x) + mlp


def stage_bytes(arch, kinds: list[str], x: ActivationInputs, *, first: bool, last: bool) -> int:
    """Peak activation bytes of one micro-batch on a rank of a stage holding layers `kinds`.

    Without recompute the peak is when the backward starts: everything the forward saved, plus
    on the last stage the logits' gradient and the loss's chunk buffers. With full recompute the
    layers keep only their inputs, and the peak is the larger of that moment (the loss's backward)
    and a layer's recomputed forward during its backward."""
    e, T, tp = x.itemsize, x.tokens, x.tp
    hidden = e * _local_tokens(x) * arch.hidden_size
    head = 0
    if first:
        head += hidden
    if last:
        vocab = x.vocab_rows or arch.vocab_size
        logits = e * T * vocab // tp
        head += 2 * hidden + 2 * logits + 2 * 4 * min(x.logprob_chunk_tokens, T) * vocab // tp
    if x.recompute == "full":
        largest_layer = max((layer_bytes(arch, k, x) for k in set(kinds)), default=0)
        return len(kinds) * hidden + max(head, largest_layer)
    return sum(layer_bytes(arch, kind, x) for kind in kinds) + head
