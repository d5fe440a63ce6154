"""The gRPC data path: a request's blocks stream as PullKV messages of at most 4 MiB of KV each,
decoded in place (`kv_transfer/grpc/wire.py`). Works between any two hosts; the fallback of every
other path."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import torch

from services.common.convert import handle_to_proto, layout_from_proto
from services.common.pb import worker_pb2
from services.engine.errors import KVNotFoundError, KVTransferError
from services.engine.kv_cache import KVCacheSpec
from services.kv_transfer.grpc.wire import chunk_tensor, decode_chunk
from services.kv_transfer.handle import KVHandle

PULL_KV_METHOD = "/pdserve.v1.KVTransfer/PullKV"


class GrpcPath:
    """PullKV from the source at `address` over `channel`, each call bounded by `timeout_s`."""

    name = "grpc"

    def __init__(self, channel: grpc.Channel, address: str, timeout_s: float) -> None:
        self.address, self.timeout_s = address, timeout_s
        self._pull = channel.unary_stream(
            PULL_KV_METHOD,
            request_serializer=worker_pb2.PullKVRequest.SerializeToString,
            response_deserializer=decode_chunk,
        )

    def stream(
        self,
        handle: KVHandle,
        first_block: int,
        on_call: Callable[[grpc.Call], object] | None,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """(block offset from `first_block`, read-only view of the received chunk) in order,
        checked to cover the requested blocks. Raises grpc.RpcError, KVTransferError."""
        request = worker_pb2.PullKVRequest(
            handle=handle_to_proto(handle, self.address), first_block=first_block
        )
        spec: KVCacheSpec | None = None
        next_block = first_block
        call = self._pull(request, timeout=self.timeout_s)
        if on_call is not None:
            on_call(call)
        for header, data in call:
            if spec is None:
                if header.layout is None:
                    raise KVTransferError(
                        f"KV stream for {handle.request_id!r} has no layout", "failed"
                    )
                spec = layout_from_proto(header.layout)
            if header.block_offset != next_block:
                raise KVTransferError(
                    f"KV stream for {handle.request_id!r}: block {header.block_offset} "
                    f"where {next_block} was due",
                    "failed",
                )
            shape = (
                spec.num_layers,
                2,
                header.num_blocks,
                spec.block_size,
                spec.num_kv_heads,
                spec.head_dim,
            )
            yield next_block - first_block, chunk_tensor(data, spec.dtype, shape)
            next_block += header.num_blocks
        if next_block != len(handle.block_ids):
            raise KVNotFoundError(
                f"KV stream for {handle.request_id!r} ended at block {next_block} of "
                f"{len(handle.block_ids)}"
            )

    def close(self) -> None:
        """Nothing of its own (the channel is the receiver's)."""
