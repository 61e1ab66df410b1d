"""One rank of one layout of the layout x family matrix (test_layout_matrix.py), under torchrun.

    python matrix_worker.py --out DIR --model NAME=HF_DIR [--model ...] [--override k=v ...]
                            [--reference] [--load-from REFERENCE_DIR]

Every model is built at this process group's layout in turn (one torchrun per layout runs every
family, so the matrix pays for process start-up and imports once per layout). For each model,
under DIR/NAME:
  import.pt    the HF tensors exported right after `load_hf_weights` (every stage leader's part,
               merged by the test): the round trip HF -> sharded Megatron -> HF must be bit-exact
  logits.pt    full-vocabulary logits of a packed batch of 3 sequences through Megatron's
               forward-only pipeline schedule (verify-hf's path), for the comparison with transformers
  steps.json   loss and grad norm of 3 optimizer steps (NLL on fixed samples; the distributed
               optimizer, as training runs it), and for a tied model at PP > 1 the largest
               difference between the first stage's embedding and the last stage's copy of it,
               after the import and after every step
  trained.pt   the HF tensors exported after the 3 steps (against the single process's)
  reloaded.pt  (with --load-from) the single process's trained weights loaded from its
               torch_dist checkpoint at this layout and exported: resuming weights at another
               layout must be bit-exact
`--reference` (one process) also saves the trained weights as DIR/NAME/ckpt for --load-from.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.bridge import export_hf_weights, load_hf_weights, owned_hf_names
from megatron_rl.config import load_config
from megatron_rl.model.policy import Policy
from megatron_rl.runtime import start_runtime
from megatron_rl.tools.verify_hf import megatron_logits, token_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from parity_worker import nll_batches  # noqa: E402

LOGIT_TOKENS = 48
STEPS = 3
BASE = ["device=cpu", "model.precision=fp32", "optimizer.lr=0.001", "optimizer.clip_grad=1.0"]


def exported(module, arch) -> dict[str, torch.Tensor]:
    """This rank's part of the HF export (empty unless it leads its pipeline stage)."""
    pairs = [(name, tensor.clone()) for bucket in export_hf_weights(module, arch, bucket_bytes=1 << 20)
             for name, tensor in bucket]
    names = [name for name, _ in pairs]
    # Weight sync sends what owned_hf_names lists: it must be exactly what the export yields, once.
    assert len(names) == len(set(names)), "a tensor was exported twice"
    assert sorted(names) == sorted(owned_hf_names(module, arch)), sorted(set(names) ^ set(owned_hf_names(module, arch)))
    return dict(pairs)


def tied_copy_gap(module) -> float | None:
    """max |first stage's embedding - last stage's output-layer copy| over the vocab shard this
    rank holds, on the last stage; None where the model holds no second copy (one stage, untied).

    The two copies sit on the ranks of Megatron's embedding group (first and last stage at the
    same TP / DP position), sharded alike over TP."""
    from megatron.core import parallel_state as ps

    if not module.share_embeddings_and_output_weights or ps.get_pipeline_model_parallel_world_size() == 1:
        return None
    if not ps.is_rank_in_embedding_group():
        return None
    mine = module.shared_embedding_or_output_weight().detach()
    both = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(both, mine.contiguous(), group=ps.get_embedding_group())
    gap = float((both[0] - both[1]).abs().max())
    return gap if ps.is_pipeline_last_stage() else None


def gather_to_rank0(value):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def run_model(name: str, config, runtime, out: Path, reference: bool, load_from: Path | None) -> None:
    cell = out / name
    cell.mkdir(parents=True, exist_ok=True)
    policy = Policy(config, runtime, total_steps=STEPS)
    module, arch = policy.module, policy.arch
    load_hf_weights(module, arch, config.model.hf_config)
    policy.optimizer.reload_model_params()
    rank = dist.get_rank()

    torch.save(exported(module, arch), cell / f"import_rank{rank}.pt")
    logits = megatron_logits(module, arch, config, runtime, token_batch(arch.vocab_size, LOGIT_TOKENS, seed=0))
    if logits is not None:
        torch.save(logits, cell / "logits.pt")

    gaps = [tied_copy_gap(module)]
    batches, loss_fn = nll_batches(policy, runtime)
    losses, norms, updated = [], [], []
    for _ in range(STEPS):
        result = policy.train_step(batches, loss_fn)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        updated.append(result.updated)
        gaps.append(tied_copy_gap(module))
    torch.save(exported(module, arch), cell / f"trained_rank{rank}.pt")
    gaps = [max((g[i] for g in gather_to_rank0(gaps) if g[i] is not None), default=None) for i in range(len(gaps))]
    if reference:
        policy.save_model(str(cell / "ckpt"))
    if load_from is not None:
        policy.load_model(str(load_from / name / "ckpt"))
        torch.save(exported(module, arch), cell / f"reloaded_rank{rank}.pt")
    if rank == 0:
        (cell / "steps.json").write_text(json.dumps(dict(loss=losses, grad_norm=norms, updated=updated,
                                                         tied_gap=gaps)))
    del policy, module
    gc.collect()
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", action="append", required=True, help="NAME=HF_DIR")
    parser.add_argument("--override", action="append", default=[])
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--load-from", default=None)
    args = parser.parse_args()
    out = Path(args.out)
    models = dict(item.split("=", 1) for item in args.model)
    configs = {name: load_config(None, [*BASE, f"model.hf_config={hf_dir}", *args.override])
               for name, hf_dir in models.items()}
    # Every model shares the layout, so the process group and Megatron's parallel state are
    # started once, from any of the configs.
    runtime = start_runtime(next(iter(configs.values())))
    load_from = Path(args.load_from) if args.load_from else None
    for name, config in configs.items():
        run_model(name, config, runtime, out, args.reference, load_from)
    runtime.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
