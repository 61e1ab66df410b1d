"""The collective transport's wire: stage leaders broadcast buckets to every engine rank.

Real gloo process groups on a real TCP store, in separate processes, as the trainer's stage
leaders and the engines' workers build them (rollout/weights/group.py). Checked: every receiver
gets every tensor bit for bit, in order, for dtypes of every width (FP8 weights with float32
scales, bf16, int64, a 0-d tensor, sizes that are not multiples of the alignment), across two
pipeline stages with one group each; and a bucket whose metadata disagrees with its payload is
refused rather than read misaligned.
"""

from __future__ import annotations

import multiprocessing
import traceback

import pytest
import torch

from _support.processes import free_port
from megatron_rl.rollout.weights.group import (
    GroupSpec,
    TensorMeta,
    host_store,
    join_stage_group,
    pack,
    receive_stage,
    send_bucket,
    send_end,
    unpack,
)

RECEIVERS = 3  # e.g. one engine at TP1 and one at TP2


def stage_tensors(stage: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Two buckets per stage, deterministic, so every process can rebuild the expected values."""
    generator = torch.Generator().manual_seed(stage)
    weight = torch.randn(5, 7, generator=generator)
    return [
        [(f"s{stage}.fp8.weight", weight.to(torch.float8_e4m3fn)),
         (f"s{stage}.fp8.weight_scale_inv", torch.rand(1, 1, generator=generator)),
         (f"s{stage}.bf16", torch.randn(3, 3, generator=generator).to(torch.bfloat16))],
        [(f"s{stage}.ids", torch.arange(11, dtype=torch.int64) * (stage + 1)),
         (f"s{stage}.scalar", torch.tensor(float(stage) + 0.5)),
         (f"s{stage}.odd", torch.randn(13, generator=generator))],
    ]


def member(role: str, index: int, spec_json: str, results) -> None:
    try:
        spec = GroupSpec.from_json(spec_json)
        if role == "leader":
            group = join_stage_group(spec, index, 0)
            for bucket in stage_tensors(index):
                send_bucket(group, bucket, torch.device("cpu"))
            send_end(group, torch.device("cpu"))
            results.put((role, index, None))
            return
        groups = [join_stage_group(spec, stage, 1 + index) for stage in range(spec.stages)]
        received = [(name, tensor.clone()) for group in groups for name, tensor in receive_stage(group, torch.device("cpu"))]
        results.put((role, index, [(name, as_bytes(tensor), str(tensor.dtype), tuple(tensor.shape))
                                   for name, tensor in received]))
    except Exception:
        results.put((role, index, traceback.format_exc()))


def as_bytes(tensor: torch.Tensor) -> list[int]:
    return tensor.reshape(-1).view(torch.uint8).tolist()


def test_two_stage_leaders_reach_every_engine_rank_bit_for_bit():
    port = free_port()
    store = host_store("127.0.0.1", port, timeout_s=60)  # trainer rank 0 hosts it
    spec = GroupSpec("127.0.0.1", port, world_size=1 + RECEIVERS, stages=2, backend="gloo", timeout_s=60)
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    processes = [context.Process(target=member, args=("leader", stage, spec.to_json(), results)) for stage in range(2)]
    processes += [context.Process(target=member, args=("engine", rank, spec.to_json(), results)) for rank in range(RECEIVERS)]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(timeout=30)
    del store
    failures = [outcome for outcome in outcomes if isinstance(outcome[2], str)]
    assert not failures, failures
    expected = [(name, as_bytes(tensor), str(tensor.dtype), tuple(tensor.shape))
                for stage in range(2) for bucket in stage_tensors(stage) for name, tensor in bucket]
    engines = sorted((index, got) for role, index, got in outcomes if role == "engine")
    assert [index for index, _ in engines] == list(range(RECEIVERS))
    for _, got in engines:
        assert got == expected


def test_a_bucket_that_disagrees_with_its_metadata_is_refused():
    tensors = [torch.arange(6, dtype=torch.float32), torch.ones(3, dtype=torch.bfloat16)]
    metas = [TensorMeta.of("a", tensors[0]), TensorMeta.of("b", tensors[1])]
    buffer = pack(tensors, torch.device("cpu"))
    assert [t.tolist() for t in unpack(buffer, metas)] == [t.tolist() for t in tensors]
    with pytest.raises(ValueError, match="does not match its metadata"):
        unpack(buffer, [metas[0], TensorMeta("b", "bfloat16", (40,))])
