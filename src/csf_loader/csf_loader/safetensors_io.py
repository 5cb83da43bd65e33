"""Byte-level safetensors reading and writing (no vLLM).

The converter must rebuild source shards bit for bit, so it works on the raw file
layout (8-byte little-endian header length, JSON header, data) instead of going
through a library that may reorder tensors or rewrite the header. Every read is
checked, and a problem is reported with the file and tensor it concerns.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}
MAX_HEADER = 100 * 1024 * 1024

TORCH_DTYPE: dict[str, torch.dtype] = {
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "U32": torch.uint32,
    "I32": torch.int32,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
}
SAFETENSORS_DTYPE = {v: k for k, v in TORCH_DTYPE.items()}


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupt or inconsistent."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offset in the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class ShardHeader:
    path: Path
    header_text: str  # the exact header bytes (padding included), decoded as UTF-8
    metadata: dict[str, str]
    tensors: dict[str, TensorEntry]  # in data-offset order
    data_start: int


def read_header(path: Path) -> ShardHeader:
    """Parse and check a shard's header against the file's size."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"{path}: shard file is missing") from None
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated: {size} bytes, no safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER or 8 + length > size:
            raise CheckpointError(f"{path}: corrupt or truncated: header length {length}, file {size} bytes")
        raw = f.read(length)
    try:
        text = raw.decode("utf-8")
        parsed = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header: {exc}") from None
    if not isinstance(parsed, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: not a JSON object")
    data_size = size - 8 - length
    metadata = parsed.pop("__metadata__", None) or {}
    entries: list[TensorEntry] = []
    for name, info in parsed.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name}: malformed header entry {info!r}") from None
        if dtype not in ITEMSIZE:
            raise CheckpointError(f"{path}: tensor {name}: unknown dtype {dtype!r}")
        numel = 1
        for d in shape:
            if not isinstance(d, int) or d < 0:
                raise CheckpointError(f"{path}: tensor {name}: bad shape {list(shape)}")
            numel *= d
        if not (0 <= begin <= end) or end - begin != numel * ITEMSIZE[dtype]:
            raise CheckpointError(
                f"{path}: tensor {name}: data_offsets [{begin}, {end}] do not hold {dtype} {list(shape)}"
            )
        if end > data_size:
            raise CheckpointError(
                f"{path}: tensor {name}: truncated: needs data up to byte {end}, the file holds {data_size}"
            )
        entries.append(TensorEntry(name, dtype, shape, begin, end))
    entries.sort(key=lambda e: e.begin)
    return ShardHeader(path, text, metadata, {e.name: e for e in entries}, 8 + length)


class ShardReader:
    """Memory-mapped access to the tensors of one checked shard."""

    def __init__(self, path: Path) -> None:
        self.header = read_header(path)
        self._file = path.open("rb")
        size = os.fstat(self._file.fileno()).st_size
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._map is not None:
            # A caller may still hold a view of the map; then the map closes when the
            # last view is released instead of now.
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None
        self._file.close()

    def raw(self, name: str) -> memoryview:
        entry = self.entry(name)
        assert self._map is not None
        start = self.header.data_start + entry.begin
        return memoryview(self._map)[start : start + entry.nbytes]

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.header.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.header.path}: tensor {name} is missing") from None

    def tensor(self, name: str) -> torch.Tensor:
        """A CPU copy of the tensor (owning its memory, so the map may close)."""
        entry = self.entry(name)
        if entry.dtype not in TORCH_DTYPE:
            raise CheckpointError(f"{self.header.path}: tensor {name}: dtype {entry.dtype} not supported here")
        data = bytearray(self.raw(name))
        flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        return flat.view(TORCH_DTYPE[entry.dtype]).reshape(entry.shape).clone()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return memoryview(flat.numpy().tobytes()) if flat.numel() else memoryview(b"")


def layout_header(items: Iterable[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str]) -> bytes:
    """Header bytes (padded to 8) for tensors stored back to back in the given order."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name, dtype, shape, nbytes in items:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def write_shard(f: BinaryIO, header: bytes, chunks: Iterable[memoryview | bytes]) -> None:
    f.write(struct.pack("<Q", len(header)))
    f.write(header)
    for chunk in chunks:
        f.write(chunk)
