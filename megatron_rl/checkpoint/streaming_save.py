"""How a Megatron checkpoint of this project is written: torch's synchronous checkpoint writer
in place of Megatron-Core's staging one (a view is copied only while it is written; a model on
the meta device gets its values one tensor at a time), each .distcp file's CRC-32 taken while
it is written, and torch.save's per-record checksums off (checkpoint/format.py writes the
checkpoint; MANIFEST.json holds the files' checksums)."""

from __future__ import annotations

import contextlib
from pathlib import Path


def streaming_save_strategy(values=None, checksums: dict | None = None):
    """Megatron-Core's torch_dist save, written by torch.distributed.checkpoint's FileSystemWriter:
    the same files (.distcp, .metadata), read by the same loader. Megatron-Core's own writer stages
    every tensor before writing (it serves asynchronous saves), and copies each tensor that is a
    view of a larger one: the two halves of every gated MLP's fc1 weight, about 60% of a MoE model,
    were held twice at once. This writer copies such a view only while writing it, one at a time,
    in this thread (one file per rank; a stop signal unwinds it like any other code).

    `values`: a callable that gives each tensor of a model built on the meta device its real value
    (called once per tensor, in write order, just before it is written), so such a model is
    saved holding one tensor at a time. An error it raises that is a ConfigError (a NaN weight in
    the source) reaches every rank as itself. `checksums`: see save_megatron_checkpoint."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    from megatron_rl.bridge.streamed import failure_to_reraise

    class ValuesOnDemand(MCoreSavePlanner):
        def resolve_data(self, write_item):
            data = super().resolve_data(write_item)
            # Every tensor, not only meta ones: a model built on the meta device still creates
            # some buffers on the CPU (the routers' expert bias, zeros) that must not be saved as such.
            return values(data) if values is not None and isinstance(data, torch.Tensor) else data

    class StreamingSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir) -> None:
            # What TorchDistSaveShardedStrategy.async_save does, with torch's synchronous writer.
            state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            try:
                writer = dcp.FileSystemWriter(checkpoint_dir)
                if checksums is not None:
                    writer.fs = _checksumming_file_system(checksums)
                with _without_record_checksums():
                    dcp.save(mcore_to_pyt_state_dict(state, False), storage_writer=writer,
                             planner=ValuesOnDemand(dedup_replicated_tensors=not self.keep_only_main_replica,
                                                    flatten_state_dict=False))
            except CheckpointException as exc:
                # torch's writer turns every rank's error into one CheckpointException, a stop signal
                # (KeyboardInterrupt, tools/ranks.Interrupted) too: that one unwinds as itself, and
                # so does a ConfigError that `values` raised on any rank.
                reraise = failure_to_reraise(exc)
                if reraise is not None:
                    raise reraise from None
                raise

    return StreamingSave("torch_dist", 1)


def _checksumming_file_system(checksums: dict):
    """torch's checkpoint file system, whose .distcp streams take their CRC-32 and size as they are
    written, into `checksums` (file name -> {"bytes", "crc32"}) once each file is closed."""
    import zlib

    from torch.distributed.checkpoint.filesystem import FileSystem

    class Checksummed:
        def __init__(self, stream):
            self._stream, self.crc, self.bytes = stream, 0, 0

        def write(self, data) -> int:
            written = self._stream.write(data)
            self.crc = zlib.crc32(data, self.crc)
            self.bytes += memoryview(data).nbytes
            return written

        def __getattr__(self, name):  # tell, flush, fileno (for fsync), ...: the file's own
            return getattr(self._stream, name)

    class ChecksummingFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path, mode):
            with super().create_stream(path, mode) as stream:
                if mode != "wb" or not str(path).endswith(".distcp"):
                    yield stream
                    return
                checksummed = Checksummed(stream)
                yield checksummed
            checksums[Path(path).name] = {"bytes": checksummed.bytes, "crc32": f"{checksummed.crc & 0xFFFFFFFF:08x}"}

    return ChecksummingFileSystem()


@contextlib.contextmanager
def _without_record_checksums():
    """torch.save (which torch's checkpoint writer calls once per tensor) without its CRC-32 of
    every zip record: computing it made torch.save write in small pieces, 1.05 GB/s instead of
    4.3 GB/s on this project's CPU machines (measured on 512 MiB tensors), the slowest part of a
    conversion. torch.load reads such records the same; the MANIFEST.json that every conversion
    and training checkpoint carries holds each file's CRC-32. torch's setting is process-wide:
    restored when the block ends."""
    import torch

    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)
