"""KV transfer over gRPC: bandwidth against a bare grpcio byte stream, and its share of TTFT.

1. Bandwidth. A real local cluster (`pdserve serve`, default model) prefills a long prompt on its
   prefill worker, which pins the prompt's KV (float32: 45 KiB per token). This process then
   pulls that KV `--trials` times through `GrpcKVReceiver.pull_chunks`, the decode worker's own
   path (PullKV stream of <= 4 MiB chunks read from the prefill worker's cache, each written as
   it arrives into a preallocated KV tensor, as the decode worker writes into its reserved
   blocks), and, interleaved in the same run, streams the same number of bytes from a bare
   grpcio server in another process (a generic handler yielding a prebuilt payload of the same
   size as 4 MiB `bytes` messages; the client drops each on arrival). Target: the gRPC path
   moves >= 80% of the bare stream's bytes/s. This process runs torch on one thread, as a decode
   worker's RPC thread copies without the intra-op pool.
2. Share of TTFT. Through the same cluster's router, prompts of 128 to 4,096 tokens; the router's
   own timings of each request give TTFT (request received -> first token sent) and the decode
   worker's pull time. pdserve streams the first token as soon as the prefill samples it, before
   the transfer starts, so the transfer is 0% of its TTFT by construction; the table also gives
   transfer / (TTFT + transfer), the share it would have in a design whose first token waits
   for the decode worker (a P/D proxy that sends max_tokens=1 to prefill, then decodes).

    python benchmarks/kv_transfer.py             # ~2 min
    python benchmarks/kv_transfer.py --trials 5 --pull-tokens 4096

Prints tables and writes JSON (default benchmarks/results/kv_transfer.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cluster import start_serve  # noqa: E402 - after the path setup
from prefix_cache import text_ids  # noqa: E402
from report import write_result  # noqa: E402

BARE_METHOD = "/bench.ByteStream/Stream"
CHUNK_BYTES = 4 * 1024 * 1024


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(
        "--pull-tokens", type=int, default=4096, help="prompt tokens whose KV is pulled"
    )
    parser.add_argument("--trials", type=int, default=15, help="pulls of each kind (median counts)")
    parser.add_argument("--prompt-lengths", default="128,512,1024,2048,4096")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each worker")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kv_transfer.json"))
    parser.add_argument("--bare-server", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


# -- the bare grpcio byte stream -----------------------------------------------------------------


def bare_server() -> None:
    """Serve BARE_METHOD: the request is a byte count (decimal); the reply streams a payload of
    that many random bytes, prebuilt once as distinct 4 MiB `bytes` messages (read from memory,
    as a KV cache is, not one hot buffer sent over and over). Prints the port, then serves until
    killed."""
    import grpc

    from services.common.server import SERVER_OPTIONS

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


def pull_into(transfer, handle, destination) -> float:
    """Seconds to pull the handle's KV and write each chunk into `destination` as it arrives, as
    the decode worker writes into the request's reserved cache blocks."""
    start = time.perf_counter()
    for offset, piece in transfer.pull_chunks(handle):
        destination[:, :, offset : offset + piece.shape[2]].copy_(piece)
    return time.perf_counter() - start


# -- 1. bandwidth ---------------------------------------------------------------------------------


def bandwidth(args, prefill_address: str) -> dict:
    import grpc
    import torch

    from services.common.channels import GRPC_OPTIONS
    from services.common.convert import handle_from_proto
    from services.common.kv_transfer_grpc import GrpcKVReceiver
    from services.common.pb import common_pb2, worker_pb2, worker_pb2_grpc

    prompt = text_ids(args.model, args.pull_tokens, offset=1000)
    stub = worker_pb2_grpc.PrefillStub(grpc.insecure_channel(prefill_address))
    reply = stub.Prefill(
        worker_pb2.PrefillRequest(
            request_id="bench-pull",
            prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        ),
        timeout=300,
    )
    handle, source = handle_from_proto(reply.kv_handle)
    transfer = GrpcKVReceiver(timeout_s=120, role="bench")
    transfer.set_source(handle.request_id, source)  # renews the lease while we pull
    bare = subprocess.Popen(
        [sys.executable, __file__, "--bare-server"], stdout=subprocess.PIPE, text=True
    )
    try:
        channel = grpc.insecure_channel(
            f"127.0.0.1:{bare.stdout.readline().strip()}", options=GRPC_OPTIONS
        )
        destination = torch.cat(
            transfer.pull(handle), dim=2
        )  # also warms up; like the cache, allocated once
        nbytes = destination.numel() * destination.element_size()
        expected = destination.clone()
        pull_bare(channel, nbytes)
        grpc_s, bare_s = [], []
        for _ in range(args.trials):  # interleaved: both see the same machine state
            destination.zero_()
            grpc_s.append(pull_into(transfer, handle, destination))
            assert torch.equal(destination, expected)
            bare_s.append(pull_bare(channel, nbytes))
    finally:
        bare.kill()
        transfer.close()
        worker_pb2_grpc.KVTransferStub(grpc.insecure_channel(source)).ReleaseKV(
            worker_pb2.ReleaseKVRequest(request_id=handle.request_id), timeout=30
        )
    grpc_rate, bare_rate = nbytes / statistics.median(grpc_s), nbytes / statistics.median(bare_s)
    return {
        "prompt_tokens": args.pull_tokens,
        "bytes": nbytes,
        "grpc_path_seconds": grpc_s,
        "bare_seconds": bare_s,
        "grpc_path_bytes_per_s": grpc_rate,
        "bare_bytes_per_s": bare_rate,
        "ratio": grpc_rate / bare_rate,
    }


# -- 2. share of TTFT ------------------------------------------------------------------------------


def ttft_share(args, router: str, bytes_per_token: int) -> list[dict]:
    import grpc

    from services.common.pb import common_pb2, generate_pb2, generate_pb2_grpc

    stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(router))
    rows = []
    for i, num_tokens in enumerate(int(n) for n in args.prompt_lengths.split(",")):
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(
                ids=text_ids(args.model, num_tokens, offset=20000 + 100 * i)
            ),
            sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        )
        timings = [m.timings for m in stub.Generate(request, timeout=600) if m.finish_reason][0]
        rows.append(
            {
                "prompt_tokens": num_tokens,
                "ttft_s": timings.ttft,
                "kv_transfer_s": timings.kv_transfer,
                "kv_bytes": num_tokens * bytes_per_token,
                "share_of_ttft": 0.0,
                "share_if_first_token_waited": timings.kv_transfer
                / (timings.ttft + timings.kv_transfer),
            }
        )
    return rows


def main() -> None:
    args = parse_args()
    if args.bare_server:
        return bare_server()
    import torch

    torch.set_num_threads(1)
    process, ready = start_serve(
        args.model,
        "--prefill-threads",
        str(args.threads),
        "--decode-threads",
        str(args.threads),
        "--no-enable-prefix-caching",
    )
    try:
        prefill = next(s["grpc"] for s in ready["services"] if s["role"] == "prefill")
        bw = bandwidth(args, prefill)
        shares = ttft_share(args, ready["router"], bw["bytes"] // bw["prompt_tokens"])
    finally:
        process.terminate()
        process.wait(timeout=60)
    mib = 1024 * 1024
    print(
        f"\nKV pull of a {bw['prompt_tokens']}-token prompt ({bw['bytes'] / mib:.0f} MiB), "
        f"median of {args.trials}:"
    )
    print(
        "  bare grpcio byte stream (messages dropped)       "
        f"{bw['bare_bytes_per_s'] / mib:8.0f} MiB/s"
    )
    print(
        "  pdserve gRPC KV path (written into a KV tensor)  "
        f"{bw['grpc_path_bytes_per_s'] / mib:8.0f} MiB/s   "
        f"{bw['ratio']:.0%} of bare (target >= 80%)"
    )
    print(
        "\nprompt tokens | KV MiB | TTFT ms | transfer ms | in TTFT | "
        "share if the first token waited"
    )
    for row in shares:
        print(
            f"{row['prompt_tokens']:13d} | {row['kv_bytes'] / mib:6.1f} | "
            f"{row['ttft_s'] * 1e3:7.0f} | "
            f"{row['kv_transfer_s'] * 1e3:11.1f} | {row['share_of_ttft']:7.0%} | "
            f"{row['share_if_first_token_waited']:.1%}"
        )
    write_result(
        "kv_transfer.py",
        args,
        args.threads,
        {"bandwidth": bw, "ttft_share": shares},
        skip=("bare_server",),
    )


if __name__ == "__main__":
    main()
