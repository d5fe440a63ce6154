"""A bare grpcio byte stream in its own process: the baseline of the gRPC KV path in
`kv_transfer.py` (issue 7's target: the gRPC path at >= 80% of it).

    python benchmarks/bare_grpc.py   # prints its port, then serves until killed
"""

from __future__ import annotations

import os
import sys
import time
from concurrent import futures
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BARE_METHOD = "/bench.ByteStream/Stream"
CHUNK_BYTES = 4 * 1024 * 1024


def bare_server() -> None:
    """Serve BARE_METHOD: the request is a byte count (decimal); the reply streams a payload of
    that many random bytes, prebuilt once as distinct 4 MiB `bytes` messages (read from memory,
    as a KV cache is, not one hot buffer sent over and over). Prints the port, then serves until
    killed."""
    import grpc

    from services.common.grpc_server import SERVER_OPTIONS

    payloads: dict[int, list[bytes]] = {}

    def stream(request: bytes, context):
        size = int(request)
        if size not in payloads:
            payloads[size] = [
                os.urandom(min(CHUNK_BYTES, size - at)) for at in range(0, size, CHUNK_BYTES)
            ]
        yield from payloads[size]

    handler = grpc.method_handlers_generic_handler(
        "bench.ByteStream",
        {
            "Stream": grpc.unary_stream_rpc_method_handler(stream, lambda b: b, lambda b: b),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


def pull_bare(channel, nbytes: int) -> float:
    """Seconds to receive `nbytes` from the bare server (each message dropped on arrival)."""
    call = channel.unary_stream(
        BARE_METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    start = time.perf_counter()
    received = sum(len(message) for message in call(str(nbytes).encode(), timeout=120))
    elapsed = time.perf_counter() - start
    assert received == nbytes, (received, nbytes)
    return elapsed


if __name__ == "__main__":
    bare_server()
