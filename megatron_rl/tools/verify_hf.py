"""`megatron-rl verify-hf`: does Megatron compute what transformers computes for this model?

    megatron-rl verify-hf --hf-dir DIR [--tp N] [--pp N] [--ep N] [--etp N] [--tolerance T] [--tokens N] [--seed S]

The first thing to run after downloading or converting a model. It loads DIR's safetensors into
the Megatron model at the layout given, exactly as `convert hf-to-megatron` and
`train checkpoint.init_from=DIR` do (`megatron_rl.bridge.load_hf_weights`), runs one packed batch
of random token ids through it (fp32, eval), runs the same sequences through transformers
(`AutoModelForCausalLM`, fp32, eval) and compares the logits. The last line says how it went:

    verify-hf: max |logit diff| = 2.861e-06 over 96 tokens (tolerance 0.0001): ok        exit 0
    verify-hf: max |logit diff| = 1.523e+00 over 96 tokens (tolerance 0.0001): FAILED    exit 1

Bad input (no such directory, no config.json, an unsupported architecture, a layout that does not
divide the model, a torchrun world of the wrong size, unreadable safetensors, a file that disagrees
with the MANIFEST.json a conversion wrote) is one line on stderr and exit 2, before any process
starts or any weight is loaded. A layout needing several
ranks starts torchrun itself (as the conversion tools do); it also runs under a torchrun the
user started, with exactly the number of processes the layout needs.

The batch is several sequences of different lengths packed into one micro-batch, the way training
runs them, so the check also covers packing (attention kept inside each sequence, RoPE positions
restarting per sequence); transformers runs each sequence alone.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
from pathlib import Path

from megatron_rl.config import RunConfig

from megatron_rl.errors import ConfigError

PREFIX = "megatron-rl verify-hf"
# Set by the launching process for the ranks it starts: a directory where each rank leaves its
# exit code (see _launch).
REPORT_ENV = "MEGATRON_RL_VERIFY_REPORT"
# transformers and Megatron agree to ~1e-6 in fp32 on small models; bigger models accumulate more.
DEFAULT_TOLERANCE = 1e-4
DEFAULT_TOKENS = 96


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PREFIX, description="compare Megatron's logits with transformers' for a Hugging Face model directory")
    parser.add_argument("--hf-dir", required=True, help="the model: config.json and *.safetensors")
    for name, what in (("tp", "tensor"), ("pp", "pipeline"), ("ep", "expert")):
        parser.add_argument(f"--{name}", type=int, default=1, help=f"{what} parallel size (default 1)")
    parser.add_argument("--etp", type=int, default=None, help="expert tensor parallel (default: same as --tp)")
    from megatron_rl.tools.ranks import stage_args

    stage_args(parser)
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help=f"largest allowed |logit difference| (default {DEFAULT_TOLERANCE:g}, fp32)")
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                        help=f"token ids in the batch, split over up to 3 sequences (default {DEFAULT_TOKENS})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random token ids (default 0)")
    return parser


def token_batch(vocab_size: int, total: int, seed: int) -> list[list[int]]:
    """`total` token ids drawn uniformly from the vocabulary, as up to 3 sequences of different
    lengths (about 1/2, 1/3 and 1/6 of them). Several sequences of unequal length: a packed batch
    that leaked attention or positions from one sequence into the next would show. The same
    `seed` gives the same batch on every rank and in every run."""
    import torch

    first = -(-total // 2)
    second = -(-(total - first) * 2 // 3)
    lengths = [n for n in (first, second, total - first - second) if n > 0]
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (total,), generator=generator).tolist()
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [ids[start:start + n] for start, n in zip(starts, lengths)]


def verdict_line(diff: float, tokens: int, tolerance: float) -> tuple[bool, str]:
    """(passed, the last line). NaN never passes."""
    passed = diff <= tolerance
    return passed, (f"verify-hf: max |logit diff| = {diff:.3e} over {tokens} tokens "
                    f"(tolerance {tolerance:g}): {'ok' if passed else 'FAILED'}")


# ---- checks before any process starts --------------------------------------------------------


def check_input(args) -> tuple[RunConfig, object, int]:
    """(config, architecture, world size) after every check that needs no process and no weight:
    the arguments, DIR and its config.json, the architecture, the layout against the model, the
    safetensors headers, the files against DIR's MANIFEST.json if it has one (sizes and CRC-32)
    and, under torchrun, the world size. Raises ConfigError with one line naming the value and
    what to do."""
    from megatron_rl.tools.ranks import hf_model_config, validate_layout, world_size_for
    from megatron_rl.model.hf_config import load_hf_config, parse_hf_config

    if args.tokens < 1:
        raise ConfigError(f"--tokens {args.tokens}: needs at least 1 token")
    if not args.tolerance >= 0:
        raise ConfigError(f"--tolerance {args.tolerance}: must be a number >= 0")
    hf_dir = Path(args.hf_dir)
    if not hf_dir.is_dir():
        what = "is a file" if hf_dir.exists() else "does not exist"
        raise ConfigError(f"--hf-dir {hf_dir} {what}; pass the directory of a Hugging Face model "
                          "(config.json and *.safetensors)")
    if not (hf_dir / "config.json").is_file():
        raise ConfigError(f"--hf-dir {hf_dir} holds no config.json; pass the directory of a Hugging Face "
                          "model (the one with config.json and *.safetensors)")
    arch = parse_hf_config(*load_hf_config(hf_dir))  # an unsupported architecture is named here
    config = hf_model_config(str(hf_dir), args, "fp32")  # fp32: the comparison is meant to be tight
    validate_layout(config)  # the layout against the model, as the conversion tools check it

    from megatron_rl.bridge.importer import check_files
    from megatron_rl.checkpoint.format import REDOWNLOAD_OR_CONVERT, check_intact

    check_files(hf_dir)  # no *.safetensors, or a truncated one
    if REPORT_ENV not in os.environ:  # the ranks _launch starts: the launching process checked
        check_intact(hf_dir, REDOWNLOAD_OR_CONVERT)  # a `convert megatron-to-hf` output carries checksums
    world = world_size_for(config)
    if "RANK" in os.environ:
        started = int(os.environ.get("WORLD_SIZE", "1"))
        if started != world:
            raise ConfigError(
                f"started under torchrun with {started} processes, but --tp {args.tp} --pp {args.pp} --ep {args.ep}"
                f" --etp {config.parallel.expert_tp} needs {world}; use torchrun --nproc-per-node={world}, "
                "or run verify-hf without torchrun (it starts the processes itself)")
    return config, arch, world


# ---- on each rank -----------------------------------------------------------------------------


def megatron_logits(module, arch, config: RunConfig, runtime, sequences: list[list[int]]):
    """Full-vocabulary logits [tokens, vocab_size] of `sequences`, packed into one micro-batch,
    on one rank (the last pipeline stage's first TP rank of the first DP group); None elsewhere.

    Runs Megatron's forward-only schedule as the policy does, so PP > 1 passes activations between
    stages; with PP 1 it is a plain forward. The vocab-parallel logits are gathered over TP in the
    loss callback (every TP rank of the last stage runs it) and the padding rows of the vocabulary
    and of the packed row are trimmed."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rl.model.fp8 import micro_batch_multiple
    from megatron_rl.model.packing import pack
    from megatron_rl.runtime.cpu import megatron_patches as cpu_compat

    parallel = config.parallel
    multiple = micro_batch_multiple(config.model, parallel.tp if parallel.uses_sequence_parallel else 1)
    batch = pack(sequences, [1] * len(sequences), pad_to_multiple=multiple).to(runtime.device)
    real = sum(len(s) for s in sequences)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    kept = []

    def keep(logits):  # [1, T, vocab rows / tp] on the last stage
        with cpu_compat.suspended():
            local = logits[0].contiguous()
            shards = [torch.empty_like(local) for _ in range(tp_group.size())]
            dist.all_gather(shards, local, group=tp_group)
            kept.append(torch.cat(shards, dim=-1)[:real, : arch.vocab_size].float().cpu())
            return logits.sum() * 0.0, torch.tensor(real, dtype=torch.int, device=logits.device), {}

    def forward_step(data_iterator, model):
        micro = next(data_iterator)
        with cpu_compat.suspended():  # the forward names no CUDA device (see cpu_compat)
            output = model(input_ids=micro.input_ids, position_ids=micro.position_ids, attention_mask=None,
                           packed_seq_params=micro.packed_seq_params())
        return output, keep

    module.eval()
    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([batch]), model=[module], num_microbatches=1,
            seq_length=batch.num_tokens, micro_batch_size=1, forward_only=True,
        )
    owner = kept and runtime.tp_rank == 0 and runtime.dp_rank == 0
    return kept[0] if owner else None


def hf_logits(hf_dir: str, sequences: list[list[int]]):
    """transformers' logits [tokens, vocab_size], fp32, each sequence run alone."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    if os.environ.get("MEGATRON_RL_VERBOSE") != "1":
        logging.disable_progress_bar()  # "Loading weights" would be printed after the verdict's context
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return torch.cat([model(torch.tensor([s])).logits[0].float() for s in sequences])


def compare(hf_dir: str, sequences: list[list[int]], megatron, tolerance: float) -> tuple[bool, str]:
    """(passed, last line), or raises ConfigError when transformers cannot run the model."""
    try:
        reference = hf_logits(hf_dir, sequences)
    except Exception as exc:  # noqa: BLE001 - one line instead of transformers' traceback
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise ConfigError(f"transformers cannot run the model in {hf_dir} ({type(exc).__name__}: {first}); "
                          "upgrade transformers, or check the directory") from exc
    if reference.shape != megatron.shape:
        raise ConfigError(f"transformers gives logits of shape {list(reference.shape)}, Megatron "
                          f"{list(megatron.shape)}: config.json's vocab_size does not match the weights")
    diff = float((megatron - reference).abs().max())
    return verdict_line(diff, megatron.shape[0], tolerance)


def _share_from_owner(value, is_owner: bool):
    """`value` of the one rank where `is_owner` is true, on every rank. Collective."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, is_owner)
    shared = [value]
    dist.broadcast_object_list(shared, src=flags.index(True))
    return shared[0]


def verify_on_this_rank(args, config: RunConfig) -> int:
    """One rank's part: load, forward, and on the owner of the logits, compare with transformers.
    Returns the exit code, the same on every rank (0 ok, 1 FAILED)."""
    from megatron_rl.bridge import load_hf_weights
    from megatron_rl.tools.ranks import model_on_this_rank

    with model_on_this_rank(config) as (runtime, built):
        load_hf_weights(built.module, built.arch, args.hf_dir)
        sequences = token_batch(built.arch.vocab_size, args.tokens, args.seed)
        logits = megatron_logits(built.module, built.arch, config, runtime, sequences)
        # Drop this rank's Megatron weights before transformers loads the whole model here.
        built.module = None
        gc.collect()
        outcome = None
        if logits is not None:
            try:
                outcome = compare(args.hf_dir, sequences, logits, args.tolerance)
            except ConfigError as exc:
                outcome = str(exc)
        # Every rank learns the outcome: they end together, with the same code.
        outcome = _share_from_owner(outcome, logits is not None)
    if isinstance(outcome, str):
        raise ConfigError(outcome)
    passed, line = outcome
    if logits is not None:
        print(line, flush=True)
    return 0 if passed else 1


# ---- launching ---------------------------------------------------------------------------------


def _launch(world: int, argv: list[str]) -> int:
    """Run the ranks under torchrun; the exit code they reported.

    The ranks report a FAILED verdict through REPORT_ENV and exit 0 (they all reached it, nothing
    hangs): exiting 1 would make torchrun print its ChildFailedError traceback after the verdict,
    which must be the last line. An error still exits nonzero in the ranks, so torchrun stops all
    of them; its code 2 comes back through the report too (torchrun itself would say 1)."""
    from megatron_rl.tools.ranks import torchrun

    with tempfile.TemporaryDirectory(prefix="verify-hf-") as report:
        code = torchrun(world, "megatron_rl.tools.verify_hf", argv, env={REPORT_ENV: report})
        reported = [int(p.read_text() or 1) for p in Path(report).glob("rank*")]
    if 2 in reported:
        return 2
    if code != 0:
        return code
    if len(reported) != world:
        print(f"{PREFIX}: {world - len(reported)} of {world} processes ended without a verdict", file=sys.stderr)
        return 1
    return max(reported)


def _report(code: int) -> int:
    """This rank's exit code: under our own torchrun, written for _launch, and 0 after a verdict."""
    report = os.environ.get(REPORT_ENV)
    if report is None or "RANK" not in os.environ:
        return code
    (Path(report) / f"rank{os.environ['RANK']}").write_text(str(code))
    return 0 if code == 1 else code


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    rank = os.environ.get("RANK", "0")
    try:
        config, arch, world = check_input(args)
    except ConfigError as exc:
        if rank == "0":  # the same on every rank
            print(f"{PREFIX}: {exc}", file=sys.stderr)
        return 2
    if rank == "0" and REPORT_ENV not in os.environ:
        p = config.parallel
        processes = f"{world} processes" if world > 1 else "1 process"
        print(f"verify-hf: {arch.architecture} from {args.hf_dir} at tp={p.tp} pp={p.pp} ep={p.ep} "
              f"etp={p.expert_tp} ({processes}), fp32, {args.tokens} tokens", flush=True)
    if world > 1 and "RANK" not in os.environ:
        return _launch(world, argv)
    try:
        code = verify_on_this_rank(args, config)
    except ConfigError as exc:
        print(f"{PREFIX}: {exc}", file=sys.stderr)
        code = 2
    return _report(code)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Quiet like the CLI and the conversion tools; MEGATRON_RL_VERBOSE=1 keeps the dependencies' warnings.
    if os.environ.get("MEGATRON_RL_VERBOSE") != "1":
        from megatron_rl.observability.console import quiet_dependencies

        quiet_dependencies()
    from megatron_rl.tools.ranks import Interrupted, signals_raise

    try:
        with signals_raise():
            return run(argv)
    except Interrupted as exc:
        if not exc.reported and os.environ.get("RANK", "0") == "0":
            print(f"{PREFIX}: stopped by {exc}", file=sys.stderr)
        return 128 + exc.number


if __name__ == "__main__":
    sys.exit(main())
