"""Write safetensors files one tensor at a time, with a CRC-32 of every file taken as it is written.

`safetensors.torch.save_file` takes a whole file's tensors at once, so a writer holds a file's
worth of tensors (the conversions wrote 2 GiB files: 2 GiB held). A safetensors file is an
8-byte little-endian header length, a JSON header naming every tensor's dtype, shape and byte
range, then the bytes in that order. When the names, dtypes and shapes are known before any
value is (a conversion knows them from the model built on the meta device), the header can be
written first and the values streamed after it: the writer holds one tensor.

    layout = plan_files([(name, dtype, shape), ...], file_bytes=2 << 30)
    with SafetensorsStream(directory, layout) as out:
        for name, tensor in values_in_layout_order:
            out.write(name, tensor)
    out.index()        # the weight map of model.safetensors.index.json
    out.checksums      # {file: {"bytes", "crc32"}}: MANIFEST.json's entries, no second read

The files follow the format the library reads (tests/bridge/test_safetensors_stream.py reads
them with `safetensors.safe_open`): the header padded with spaces to a multiple of 8 bytes, no
gaps between tensors, and a "__metadata__" of {"format": "pt"} as `save_file` writes for PyTorch.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Bytes per write call. On this project's CPU machines one write() of a whole tensor (hundreds of
# MB) into the page cache ran at 0.4-0.9 GB/s and the same bytes in 1 MiB calls at 3-4 GB/s.
WRITE_BYTES = 1 << 20
DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
          torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.float8_e8m0fnu: "F8_E8M0",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint64: "U64",
          torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8", torch.bool: "BOOL"}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}  # reading: the header's name -> torch's


@dataclass
class PlannedFile:
    name: str
    tensors: list[tuple[str, torch.dtype, tuple[int, ...]]] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(_nbytes(dtype, shape) for _, dtype, shape in self.tensors)


def _nbytes(dtype: torch.dtype, shape) -> int:
    return math.prod(shape) * dtype.itemsize


def plan_files(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], file_bytes: int) -> list[PlannedFile]:
    """Tensors, in the order they will be written, into files of at most `file_bytes` each (a
    larger tensor gets a file of its own), named model-0000i-of-0000N.safetensors as
    `save_pretrained` names them."""
    files: list[PlannedFile] = []
    size = 0
    for name, dtype, shape in tensors:
        if dtype not in DTYPES:
            raise ValueError(f"tensor {name}: dtype {dtype} has no safetensors name")
        nbytes = _nbytes(dtype, shape)
        if not files or (files[-1].tensors and size + nbytes > file_bytes):
            files.append(PlannedFile(""))
            size = 0
        files[-1].tensors.append((name, dtype, tuple(shape)))
        size += nbytes
    for index, planned in enumerate(files, start=1):
        planned.name = f"model-{index:05d}-of-{len(files):05d}.safetensors"
    return files


def header_bytes(planned: PlannedFile) -> bytes:
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in planned.tensors:
        nbytes = _nbytes(dtype, shape)
        entries[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class SafetensorsStream:
    """Writes the planned files in `directory`, in order; `write` must be called for every planned
    tensor in the planned order with the planned dtype and shape (anything else is a bug in the
    caller, refused before a byte of it is written)."""

    def __init__(self, directory: str | Path, files: list[PlannedFile]):
        self.directory = Path(directory)
        self.files = files
        self.checksums: dict[str, dict] = {}
        self._file_index, self._tensor_index = 0, 0
        self._handle = None
        self._crc = 0
        self._written = 0

    def __enter__(self) -> "SafetensorsStream":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if kind is None and self._file_index < len(self.files):
            missing = self.files[self._file_index].tensors[self._tensor_index][0]
            raise RuntimeError(f"safetensors stream closed before tensor {missing} was written")

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._file_index >= len(self.files):
            raise RuntimeError(f"tensor {name} was not planned: every planned file is written")
        planned = self.files[self._file_index]
        want_name, dtype, shape = planned.tensors[self._tensor_index]
        if (name, tensor.dtype, tuple(tensor.shape)) != (want_name, dtype, shape):
            raise RuntimeError(f"safetensors stream: got {name} {tensor.dtype} {list(tensor.shape)}, planned "
                               f"{want_name} {dtype} {list(shape)}")
        if self._handle is None:
            self._open(planned)
        data = memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        for start in range(0, len(data), WRITE_BYTES):
            piece = data[start:start + WRITE_BYTES]
            self._handle.write(piece)
            self._crc = zlib.crc32(piece, self._crc)
        self._written += len(data)
        self._tensor_index += 1
        if self._tensor_index == len(planned.tensors):
            self._close(planned)

    def _open(self, planned: PlannedFile) -> None:
        self._handle = open(self.directory / planned.name, "wb")
        header = header_bytes(planned)
        self._handle.write(header)
        self._crc = zlib.crc32(header)
        self._written = len(header)

    def _close(self, planned: PlannedFile) -> None:
        self._handle.flush()
        os.fsync(self._handle.fileno())  # on disk before the manifest says the directory is whole
        self._handle.close()
        self._handle = None
        self.checksums[planned.name] = {"bytes": self._written, "crc32": f"{self._crc & 0xFFFFFFFF:08x}"}
        self._file_index += 1
        self._tensor_index = 0

    def index(self) -> dict:
        """model.safetensors.index.json's content."""
        weight_map = {name: planned.name for planned in self.files for name, _, _ in planned.tensors}
        total = sum(planned.bytes for planned in self.files)
        return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
