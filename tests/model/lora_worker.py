"""Two ranks of the LoRA checks (tests/model/test_lora.py), one job in the module's rank pool.

1. One LoRA linear in float64 against the hand computation (output, input gradient, A and B
   gradients; the frozen weight gets none): column- and row-parallel, on one rank and split over
   two (sequence parallel, and as an expert linear whose communication the dispatcher does).
2. The tiny MoE policy at EP2 (DP2, distributed optimizer), full fine-tuning and LoRA from the
   same base weights: logprobs equal with B = 0; after a step, no gradient and no optimizer state
   for the base, the optimizer's parameters exactly the adapters; optimizer-state bytes of both;
   one local expert's adapter through SequentialMLP against a float64 hand computation; the HF
   export after the step equal to W + scale * B A computed by hand in float64.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

SEQ, BATCH, IN, OUT, RANK, ALPHA = 8, 2, 12, 10, 4, 6.0


def _max(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def linear_errors(kind: str, group, sequence_parallel: bool, expert: bool) -> dict:
    """max |error| of one LoRA linear's output and gradients against the float64 hand computation."""
    from megatron.core.model_parallel_config import ModelParallelConfig

    from megatron_rl.model.lora import LoraColumnParallelLinear, LoraRowParallelLinear, LoraSettings

    tp, rank = group.size(), group.rank()
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(SEQ, BATCH, IN, generator=g, dtype=torch.float64), torch.randn(OUT, IN, generator=g, dtype=torch.float64)
    a, b = torch.randn(RANK, IN, generator=g, dtype=torch.float64), torch.randn(OUT, RANK, generator=g, dtype=torch.float64)
    dy = torch.randn(SEQ, BATCH, OUT, generator=g, dtype=torch.float64)
    scale = ALPHA / RANK
    # The hand computation: y = x W^T + s (x A^T) B^T and its gradients for the loss sum(y * dy).
    h = x @ a.T
    y = x @ w.T + scale * h @ b.T
    dh = scale * dy @ b
    grads = dict(x=dy @ w + dh @ a, A=dh.reshape(-1, RANK).T @ x.reshape(-1, IN),
                 B=scale * dy.reshape(-1, OUT).T @ h.reshape(-1, RANK))

    config = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel and tp > 1,
                                 params_dtype=torch.float64, use_cpu_initialization=True, perform_initialization=False)
    settings = LoraSettings(rank=RANK, alpha=ALPHA, dropout=0.0, init="kaiming")
    common = dict(config=config, init_method=lambda t: None, bias=False, tp_group=group, is_expert=expert, lora=settings)
    out_rows, in_cols = slice(rank * OUT // tp, (rank + 1) * OUT // tp), slice(rank * IN // tp, (rank + 1) * IN // tp)
    seq_rows = slice(rank * SEQ // tp, (rank + 1) * SEQ // tp) if config.sequence_parallel else slice(None)
    if kind == "column":
        layer = LoraColumnParallelLinear(IN, OUT, gather_output=False, **common)
        shards = dict(weight=w[out_rows], lora_A=a, lora_B=b[out_rows])
        x_in, expected_y, dy_in = x[seq_rows], y[..., out_rows], dy[..., out_rows]
        expected_dx = grads["x"][seq_rows]
        expected = dict(A=grads["A"], B=grads["B"][out_rows])
    else:
        layer = LoraRowParallelLinear(IN, OUT, input_is_parallel=True, skip_bias_add=True, **common)
        shards = dict(weight=w[:, in_cols], lora_A=a[:, in_cols], lora_B=b)
        x_in, expected_y, dy_in = x[..., in_cols], y[seq_rows], dy[seq_rows]
        expected_dx = grads["x"][..., in_cols]
        expected = dict(A=grads["A"][:, in_cols], B=grads["B"])
    with torch.no_grad():
        for name, value in shards.items():
            getattr(layer, name).copy_(value)
    layer.weight.requires_grad_(False)  # the frozen base
    x_in = x_in.clone().requires_grad_(True)
    output, _ = layer(x_in)
    if expert and kind == "row" and tp > 1:  # the dispatcher sums the experts' partial outputs
        output = _summed(output, group)
    output.backward(dy_in)
    dx = x_in.grad
    if expert and kind == "column" and tp > 1:  # ... and the partial input gradients
        dx = dx.clone()
        dist.all_reduce(dx, group=group)
    return {"y": _max(output, expected_y), "x": _max(dx, expected_dx), "A": _max(layer.lora_A.grad, expected["A"]),
            "B": _max(layer.lora_B.grad, expected["B"]), "weight_grad": layer.weight.grad is not None}


class _Sum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _summed(tensor, group):
    return _Sum.apply(tensor, group)


def linear_checks() -> dict:
    world = dist.group.WORLD
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    out = {}
    for kind in ("column", "row"):
        out[f"{kind}_1rank"] = linear_errors(kind, alone, sequence_parallel=False, expert=False)
        out[f"{kind}_tp2_sp"] = linear_errors(kind, world, sequence_parallel=True, expert=False)
        out[f"{kind}_etp2_expert"] = linear_errors(kind, world, sequence_parallel=False, expert=True)
    return out


# ---- the policy ---------------------------------------------------------------------------------

def optimizer_state_bytes(optimizer) -> int:
    total = 0
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in part.optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
    summed = torch.tensor(total, dtype=torch.int64)
    dist.all_reduce(summed)
    return int(summed)


def optimizer_params(optimizer) -> set[int]:
    ids = set()
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(part, "buffers"):  # distributed optimizer: the model params of its buffers
            ids.update(id(p) for buffer in part.buffers for p in buffer.params)
        else:
            ids.update(id(p) for group in part.optimizer.param_groups for p in group["params"])
    return ids


def expert_check(policy) -> float:
    """One MoE layer's local experts (each with nonzero adapters) on a few tokens each, against
    silu(gate) * up -> * prob -> down with every weight W + s B A, by hand in float64."""
    experts = policy.module.decoder.layers[0].mlp.experts
    g = torch.Generator().manual_seed(5 + dist.get_rank())
    with torch.no_grad():
        for expert in experts.local_experts:
            for linear in (expert.linear_fc1, expert.linear_fc2):
                linear.lora_B.copy_(torch.randn(linear.lora_B.shape, generator=g) * 0.1)
    counts = [3, 2][: len(experts.local_experts)] + [1] * max(0, len(experts.local_experts) - 2)
    hidden = experts.local_experts[0].linear_fc1.input_size
    tokens = torch.randn(sum(counts), hidden, generator=g)
    probs = torch.rand(sum(counts), generator=g)
    with torch.no_grad():
        output, _ = experts(tokens, torch.tensor(counts), probs)
    expected, start = [], 0
    for expert, count in zip(experts.local_experts, counts):
        x, p = tokens[start:start + count].double(), probs[start:start + count].double()
        start += count

        def merged(linear):
            return linear.weight.double() + linear.lora.scale * linear.lora_B.double() @ linear.lora_A.double()

        gate, up = (x @ merged(expert.linear_fc1).T).chunk(2, dim=-1)
        expected.append(((F.silu(gate) * up) * p[:, None]) @ merged(expert.linear_fc2).T)
    return _max(output, torch.cat(expected))


def export_check(policy) -> tuple[float, int]:
    """Every HF tensor of this rank's layers, exported after the step, against the weights merged
    by hand in float64 (split into HF pieces with the bridge's own fused layouts)."""
    from megatron_rl.bridge import export_hf_weights
    from megatron_rl.bridge.layouts import split
    from megatron_rl.bridge.mappings import expand
    from megatron_rl.bridge.placement import placements

    exported = {name: t for bucket in export_hf_weights(policy.module, policy.arch, every_rank=True) for name, t in bucket}
    table = {name: (hf, layout) for name, hf, layout in expand(policy.arch)}
    worst, merged_count = 0.0, 0
    for placement in placements(policy.module):
        if placement.adapter is None:
            continue
        a, b, scale = placement.adapter
        hand = placement.param.double() + (policy.config.model.lora.alpha / policy.config.model.lora.rank) \
            * b.double() @ a.double()
        assert scale == policy.config.model.lora.alpha / policy.config.model.lora.rank
        hf_names, layout = table[placement.global_name]
        for hf_name, piece in zip(hf_names, split(layout, hand, policy.arch)):
            worst = max(worst, _max(exported[hf_name], piece))
            merged_count += 1
    return worst, merged_count


def conversion_inputs(lora, base: dict[str, torch.Tensor], out: Path) -> None:
    """For test_lora's conversion test: the LoRA policy after its step as a checkpoint at EP2
    (with the trainer state naming its model.lora), and the base and the merged models (the
    live export, B nonzero) as HF directories."""
    from safetensors.torch import save_file

    from megatron_rl.bridge import export_hf_weights
    from megatron_rl.bridge.hf_checkpoint import write_hf_config
    from megatron_rl.checkpoint.format import save_megatron_checkpoint
    from megatron_rl.config.loader import to_dict

    merged = {n: t for bucket in export_hf_weights(lora.module, lora.arch, every_rank=True) for n, t in bucket}
    ckpt = out / "ckpt"
    ckpt.mkdir(exist_ok=True)
    dist.barrier()
    save_megatron_checkpoint(lora.module, lora.raw_hf_config, ckpt, lora.config, tokenizer_dir=None,
                             source="lora_worker")
    if dist.get_rank() != 0:
        return
    (ckpt / "trainer_state.json").write_text(json.dumps({"config": to_dict(lora.config)}))
    for name, tensors in (("base", base), ("merged", merged)):
        (out / name).mkdir()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / name / "model.safetensors"))
        write_hf_config(lora.raw_hf_config, lora.arch, out / name, template_dir=None)


def referenced_checkpoint_checks(lora, config, out: Path, batches) -> dict:
    """A training checkpoint of the LoRA policy after its step, written by the trainer's own code
    (checkpoint/store.py) with its base referenced (checkpoint/base_ref.py, the base written as a
    run from random initialization writes it): what it holds, that a policy with other weights
    loaded from it becomes the saved one exactly, and that a changed base file is refused by name."""
    from megatron_rl.checkpoint import base_ref, store
    from megatron_rl.checkpoint.manager import load_training_checkpoint
    from megatron_rl.checkpoint.format import FORMAT
    from megatron_rl.config.loader import to_dict
    from megatron_rl.errors import ConfigError
    from megatron_rl.model.policy import Policy
    from megatron_rl.model.reference import ReferenceWeights

    root = out / "referenced" / "checkpoints"
    if dist.get_rank() == 0:
        root.mkdir(parents=True)
    dist.barrier()
    base = base_ref.write_base(lora, root, config, model_dir=None)
    metadata = {"format": FORMAT, "weights_dir": "weights", "padded_vocab_size": lora.module.vocab_size,
                "precision": config.model.precision, "base": base_ref.describe_written(base, root / "step_000001")}
    hf_files = {"config.json": (base / "hf_config" / "config.json").read_bytes()} if dist.get_rank() == 0 else {}
    # The KL reference as the trainer keeps it: the trained state only (the frozen base is the base).
    reference = ReferenceWeights.snapshot(lora.module).tensors
    saved = store.begin_save(root, 1, lora, {"config": to_dict(config)}, keep_last=2,
                             keyed_like_weights={"reference": reference}, metadata=metadata, hf_files=hf_files,
                             async_save=False, device=torch.device("cpu")).final
    # Another policy, every weight moved (its own init would equal the base: same seed), then loaded.
    other = Policy(config, lora.runtime)
    with torch.no_grad():
        for param in other.module.parameters():
            param.add_(0.5)
    _, extra = load_training_checkpoint(saved, other, keyed_like_weights=("reference",))
    live, loaded = lora.module.state_dict(), other.module.state_dict()
    result = {"referenced_ckpt": str(saved), "reference_names": sorted(extra["reference"]),
              "reference_equal": extra["reference"].keys() == reference.keys()
              and all(torch.equal(extra["reference"][k], v) for k, v in reference.items()),
              "loaded_equal": all(torch.equal(live[k], loaded[k]) for k in live if not k.endswith("_extra_state")),
              "loaded_logprob_diff": max(_max(x["logprobs"], y["logprobs"])
                                         for x, y in zip(lora.logprobs(batches), other.logprobs(batches)))}
    # The same with checkpoint.init_from's Hugging Face directory as the base (conversion_inputs
    # wrote it: the base's export): the checkpoint names it, and loads over it.
    hf_root = out / "referenced_hf" / "checkpoints"
    if dist.get_rank() == 0:
        hf_root.mkdir(parents=True)
    dist.barrier()
    hf_metadata = dict(metadata, base=base_ref.describe_source(out / "base"))
    hf_saved = store.begin_save(hf_root, 1, lora, {"config": to_dict(config)}, keep_last=2, keyed_like_weights={},
                                metadata=hf_metadata, hf_files=hf_files, async_save=False,
                                device=torch.device("cpu")).final
    with torch.no_grad():
        for param in other.module.parameters():
            param.add_(0.5)
    load_training_checkpoint(hf_saved, other)
    result["hf_base"] = {key: hf_metadata["base"][key] for key in ("kind", "path")}
    result["hf_base_files"] = sorted(hf_metadata["base"]["files"])
    result["hf_loaded_logprob_diff"] = max(_max(x["logprobs"], y["logprobs"])
                                           for x, y in zip(lora.logprobs(batches), other.logprobs(batches)))
    result["referenced_hf_ckpt"] = str(hf_saved)
    # A changed base: one byte of a weight file flipped (same size: only its CRC-32 tells).
    dist.barrier()
    victim = sorted((base).glob("*.distcp"))[0]
    if dist.get_rank() == 0:
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    dist.barrier()
    try:
        load_training_checkpoint(saved, other)
        result["changed_base_refused"] = None
    except ConfigError as exc:
        result["changed_base_refused"] = str(exc)
    result["changed_file"] = victim.name
    dist.barrier()
    if dist.get_rank() == 0:  # put it back for the conversion test
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    dist.barrier()
    # A base file rewritten between the check and the load (same size, other values): the check
    # passes, and the load, which reads the new bytes, refuses them (bridge/checked_read.py).
    result["swapped_base_refused"] = swapped_after_the_check(saved, other, victim, _flip_middle_byte)
    result["swapped_hf_base_refused"] = swapped_after_the_check(hf_saved, other, out / "base" / "model.safetensors",
                                                                _embedding_plus_one)
    return result


def _flip_middle_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def _embedding_plus_one(file: Path) -> None:
    """16 values of the embedding +1.0, the file rewritten in place (the same size)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(file))
    tensors["model.embed_tokens.weight"].view(-1)[:16] += 1.0
    save_file(tensors, str(file))


def swapped_after_the_check(ckpt: Path, policy, file: Path, change) -> str | None:
    """load_training_checkpoint(ckpt) with `change(file)` run by global rank 0 right after it
    checked the base (format.check_base; the ranks wait for its verdict, so no rank has read the
    base yet): the refusal, None if it loaded. The file is put back afterwards."""
    from megatron_rl.checkpoint import format
    from megatron_rl.checkpoint.manager import load_training_checkpoint
    from megatron_rl.errors import ConfigError

    original, check = file.read_bytes(), format.check_base

    def check_then_change(*args):
        base = check(*args)
        change(file)
        assert file.stat().st_size == len(original)
        return base

    format.check_base = check_then_change
    try:
        load_training_checkpoint(ckpt, policy)
        refused = None
    except ConfigError as exc:
        refused = str(exc)
    finally:
        format.check_base = check
    dist.barrier()
    if dist.get_rank() == 0:
        file.write_bytes(original)
    dist.barrier()
    return refused


BASE = ["device=cpu", "optimizer.lr=0.01", "optimizer.clip_grad=0.0", "parallel.ep=2", "parallel.etp=1"]


def policy_checks(config, runtime, out: Path) -> dict:
    from megatron_rl.config import load_config
    from megatron_rl.model.policy import Policy

    from parity_worker import nll_batches

    base_overrides = BASE
    full = Policy(config, runtime)
    lora = Policy(load_config(None, base_overrides + ["model.lora.rank=4", "model.lora.alpha=8"]), runtime)
    # The base into the LoRA model as checkpoint.init_from loads it: a checkpoint without adapters
    # (the full model's, saved at this layout), which leaves the adapters at their init.
    base_ckpt = out / "base_weights"
    full.save_model(str(base_ckpt))
    adapters_before = {k: v.clone() for k, v in lora.module.state_dict().items() if k.endswith((".lora_A", ".lora_B"))}
    lora.load_model(str(base_ckpt))
    full_state, lora_state = full.module.state_dict(), lora.module.state_dict()
    base_keys = [k for k in lora_state if not k.endswith(("_extra_state", ".lora_A", ".lora_B"))]
    batches, loss_fn = nll_batches(full, runtime)
    result = {"missing_are_adapters": bool(adapters_before) and sorted(base_keys) == sorted(
                  k for k in full_state if not k.endswith("_extra_state"))
              and all(torch.equal(lora_state[k], full_state[k]) for k in base_keys)
              and all(torch.equal(lora_state[k], v) for k, v in adapters_before.items())}
    before = full.logprobs(batches)
    with_adapters = lora.logprobs(batches)
    result["b0_logprob_diff"] = max(_max(x["logprobs"], y["logprobs"]) for x, y in zip(before, with_adapters))

    from megatron_rl.bridge import export_hf_weights

    # Copies: an unsplit weight is exported as the live parameter, which the step below changes.
    base_hf = {n: t.clone() for bucket in export_hf_weights(full.module, full.arch, every_rank=True) for n, t in bucket}
    full.train_step(batches, loss_fn)
    lora_step = lora.train_step(batches, loss_fn)
    result["lora_step_updated"] = lora_step.updated
    adapters = {name: p for name, p in lora.module.named_parameters() if name.endswith((".lora_A", ".lora_B"))}
    base = {name: p for name, p in lora.module.named_parameters() if name not in adapters}
    result["base_requires_grad"] = sorted(n for n, p in base.items() if p.requires_grad)
    result["base_with_grad"] = sorted(n for n, p in base.items() if p.grad is not None or hasattr(p, "main_grad"))
    owned = optimizer_params(lora.optimizer)
    result["optimizer_numel"] = sum(p.numel() for p in lora.module.parameters() if id(p) in owned)
    result["adapter_numel"] = sum(p.numel() for p in adapters.values())
    result["optimizer_is_adapters"] = owned == {id(p) for p in adapters.values()}
    result["adapter_names"] = sorted(adapters)
    result["b_nonzero_after_step"] = all(float(p.abs().max()) > 0 for n, p in adapters.items() if n.endswith("lora_B"))
    result["optimizer_state_bytes"] = {"full": optimizer_state_bytes(full.optimizer),
                                       "lora": optimizer_state_bytes(lora.optimizer)}
    result["export_max_error"], result["export_merged_tensors"] = export_check(lora)
    result["expert_max_error"] = expert_check(lora)
    conversion_inputs(lora, base_hf, out)
    result.update(referenced_checkpoint_checks(lora, lora.config, out, batches))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    from megatron_rl.config import load_config
    from megatron_rl.runtime import start_runtime

    config = load_config(None, BASE)
    runtime = start_runtime(config)  # the CPU layer (gloo collectives Megatron's mappings use) too
    result = {"linear": linear_checks()}
    result.update(policy_checks(config, runtime, out))
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
