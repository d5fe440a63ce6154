"""The `KVChunk` message on the wire, without copying its KV bytes through protobuf.

A PullKV stream moves hundreds of MiB; the generated protobuf code would copy every chunk into a
message and out again on each side. These two functions write and read the same protobuf wire
format (`worker.proto`'s KVChunk: any protobuf parser reads what `encode_chunk` writes, and
`decode_chunk` reads what protobuf writes), but `encode_chunk` builds the message with one copy
straight from the KV cache's memory and `decode_chunk` returns the KV bytes as a view into the
received message, which `chunk_tensor` turns into a tensor without a copy.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.common.pb import common_pb2, worker_pb2
from services.engine.errors import KVTransferError

_DATA_TAG = b"\x22"  # field 4 (data), wire type 2 (length-delimited)
_VARINT, _LEN = 0, 2
_STORAGE_DTYPES = {torch.bfloat16: torch.int16}  # frombuffer-able stand-ins (same bytes)


@dataclass(frozen=True)
class ChunkHeader:
    """A decoded KVChunk without its data."""

    block_offset: int
    num_blocks: int
    layout: common_pb2.KVLayout | None  # first chunk only


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def encode_chunk(
    block_offset: int,
    num_blocks: int,
    layout: common_pb2.KVLayout | None,
    data: Sequence[memoryview],
) -> bytes:
    """A serialized KVChunk whose data field is the concatenation of `data` (copied once)."""
    header = worker_pb2.KVChunk(
        layout=layout, block_offset=block_offset, num_blocks=num_blocks
    ).SerializeToString()
    size = sum(part.nbytes for part in data)
    return b"".join([header, _DATA_TAG, _varint(size), *data])


def decode_chunk(raw: bytes) -> tuple[ChunkHeader, memoryview]:
    """(header, a read-only view of the KV bytes) of a serialized KVChunk.

    Raises ValueError for a message that is not a well-formed KVChunk.
    """
    buf = memoryview(raw)
    fields: dict[int, int | memoryview] = {}
    pos = 0
    try:
        while pos < len(buf):
            key, pos = _read_varint(buf, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == _VARINT:
                fields[number], pos = _read_varint(buf, pos)
            elif wire_type == _LEN:
                size, pos = _read_varint(buf, pos)
                fields[number], pos = buf[pos : pos + size], pos + size
            else:
                raise ValueError(f"kv chunk: unexpected wire type {wire_type} for field {number}")
    except IndexError:
        raise ValueError("kv chunk: truncated message") from None
    if pos != len(buf):
        raise ValueError("kv chunk: truncated message")
    layout = common_pb2.KVLayout.FromString(bytes(fields[1])) if 1 in fields else None
    data = fields.get(4, memoryview(b""))
    if not isinstance(data, memoryview):
        raise ValueError(f"kv chunk: unexpected wire type {_VARINT} for field 4")
    return ChunkHeader(int(fields.get(2, 0)), int(fields.get(3, 0)), layout), data


def chunk_tensor(data: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A read-only tensor of `shape` over a chunk's received bytes (no copy: copy from it, never
    write); KVTransferError if the sizes disagree."""
    storage = _STORAGE_DTYPES.get(dtype, dtype)
    expected = torch.Size(shape).numel() * torch.empty((), dtype=storage).element_size()
    if data.nbytes != expected:
        raise KVTransferError(
            f"kv chunk: {data.nbytes} bytes do not fill {shape} {dtype} ({expected} bytes)",
            "failed",
        )
    with warnings.catch_warnings():  # read-only on purpose: the engine only copies from it
        warnings.simplefilter("ignore", UserWarning)
        tensor = (
            torch.frombuffer(data, dtype=storage) if expected else torch.empty(0, dtype=storage)
        )
    return tensor.view(dtype).view(shape) if storage is not dtype else tensor.view(shape)
