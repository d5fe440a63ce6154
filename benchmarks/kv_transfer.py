"""KV transfer over each backend (gRPC, shared memory, torch.distributed): bandwidth against a
same-size memory copy, and the second token's latency.

For each backend a real local cluster (`pdserve serve --kv-transfer-backend B`, default model,
float32: 45 KiB of KV per token, one torch thread per worker) runs, and:

1. Bandwidth. This process prefills a prompt of each length (128 to 4,096 tokens) on the
   prefill worker, which pins its KV, then pulls that KV `--trials` times through
   `GrpcKVReceiver(backend=B).pull_chunks`, the decode worker's own code path, each piece
   written as it arrives into a preallocated KV tensor (as the decode worker writes into its
   reserved blocks). Interleaved with those pulls, in the same run, it copies the same number of
   bytes between two preallocated tensors (`Tensor.copy_`, one thread): the memory-copy
   baseline. Target: shared memory at >= 50% of the memory copy's bytes/s. In the gRPC run it
   also streams the bytes of the `--pull-tokens` prompt from a bare grpcio server in another
   process (4 MiB `bytes` messages dropped on arrival), issue 7's baseline for the gRPC path
   (target >= 80%).
2. Second token. Through the same cluster's router, a greedy 2-token request per prompt length:
   the client's time to the first and to the second token, and the router's timings (TTFT and
   the decode worker's pull). pdserve streams the first token as soon as the prefill samples it;
   the second needs the KV at the decode worker, so the transfer sits in its latency.

    python benchmarks/kv_transfer.py             # ~4 min
    python benchmarks/kv_transfer.py --trials 5 --backends grpc,shared_memory

Prints tables and writes JSON (default benchmarks/results/kv_transfer.json).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bare_grpc import pull_bare  # noqa: E402 - after the path setup
from cluster import start_serve  # noqa: E402
from prefix_cache import text_ids  # noqa: E402
from report import write_result  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(
        "--pull-tokens", type=int, default=4096, help="prompt tokens whose KV is pulled"
    )
    parser.add_argument("--trials", type=int, default=15, help="pulls of each kind (median counts)")
    parser.add_argument("--backends", default="grpc,shared_memory,torch_dist")
    parser.add_argument("--prompt-lengths", default="128,512,1024,2048,4096")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each worker")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kv_transfer.json"))
    return parser.parse_args()


def pull_into(transfer, handle, destination) -> float:
    """Seconds to pull the handle's KV and write each chunk into `destination` as it arrives, as
    the decode worker writes into the request's reserved cache blocks."""
    start = time.perf_counter()
    for offset, piece in transfer.pull_chunks(handle):
        destination[:, :, offset : offset + piece.shape[2]].copy_(piece)
    return time.perf_counter() - start


# -- 1. bandwidth ---------------------------------------------------------------------------------


def _prefill(prefill_address: str, request_id: str, prompt: list[int]):
    """Prefill `prompt` at the worker; (its KVHandle, source address) with the KV pinned."""
    import grpc

    from services.common.convert import handle_from_proto
    from services.common.pb import common_pb2, worker_pb2, worker_pb2_grpc

    reply = worker_pb2_grpc.PrefillStub(grpc.insecure_channel(prefill_address)).Prefill(
        worker_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        ),
        timeout=300,
    )
    return handle_from_proto(reply.kv_handle)


def _source_peer_info(address: str):
    """The source's own KVPeerInfo (what a compatible decode worker holds)."""
    import grpc

    from services.common.convert import peer_info_from_proto
    from services.common.pb import common_pb2, worker_pb2_grpc

    stub = worker_pb2_grpc.AdminStub(grpc.insecure_channel(address))
    info = stub.GetInfo(common_pb2.InfoRequest(), timeout=30)
    return peer_info_from_proto(info.model_id, info.kv_layout)


def bandwidth(args, backend: str, prefill_address: str) -> list[dict]:
    """One row per prompt length: the backend's bytes/s and the memory copy's, both medians."""
    import grpc
    import torch

    from services.common.channels import GRPC_OPTIONS
    from services.common.pb import worker_pb2, worker_pb2_grpc
    from services.kv_transfer.control.receiver import GrpcKVReceiver

    rows = []
    local = _source_peer_info(prefill_address)
    transfer = GrpcKVReceiver(timeout_s=120, role="bench", backend=backend, engine_id="bench")
    bare = None
    if backend == "grpc":
        bare = subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks" / "bare_grpc.py")],
            stdout=subprocess.PIPE,
            text=True,
        )
        channel = grpc.insecure_channel(
            f"127.0.0.1:{bare.stdout.readline().strip()}", options=GRPC_OPTIONS
        )
    try:
        for i, num_tokens in enumerate(int(n) for n in args.prompt_lengths.split(",")):
            prompt = text_ids(args.model, num_tokens, offset=1000 + 100 * i)
            handle, source = _prefill(prefill_address, f"bench-pull-{backend}-{i}", prompt)
            transfer.set_source(handle.request_id, source)  # renews the lease while we pull
            transfer.connect(handle, local)
            destination = torch.cat(transfer.pull(handle), dim=2)  # warms up; allocated once
            nbytes = destination.numel() * destination.element_size()
            expected, copy_from = destination.clone(), torch.randn_like(destination)
            path_s, copy_s, bare_s = [], [], []
            if bare is not None and num_tokens == args.pull_tokens:
                pull_bare(channel, nbytes)  # the server builds its payload of this size once
            for _ in range(args.trials):  # interleaved: both see the same machine state
                destination.zero_()
                path_s.append(pull_into(transfer, handle, destination))
                assert torch.equal(destination, expected)
                start = time.perf_counter()
                destination.copy_(copy_from)
                copy_s.append(time.perf_counter() - start)
                if bare is not None and num_tokens == args.pull_tokens:
                    bare_s.append(pull_bare(channel, nbytes))
            transfer.forget(handle.request_id)
            worker_pb2_grpc.KVTransferStub(grpc.insecure_channel(source)).ReleaseKV(
                worker_pb2.ReleaseKVRequest(request_id=handle.request_id), timeout=30
            )
            rate = nbytes / statistics.median(path_s)
            row = {
                "backend": backend,
                "prompt_tokens": num_tokens,
                "bytes": nbytes,
                "path_seconds": path_s,
                "memcpy_seconds": copy_s,
                "bytes_per_s": rate,
                "memcpy_bytes_per_s": nbytes / statistics.median(copy_s),
            }
            row["share_of_memcpy"] = rate / row["memcpy_bytes_per_s"]
            if bare_s:
                row["bare_grpc_bytes_per_s"] = nbytes / statistics.median(bare_s)
                row["share_of_bare_grpc"] = rate / row["bare_grpc_bytes_per_s"]
            rows.append(row)
    finally:
        if bare is not None:
            bare.kill()
        transfer.close()
    return rows


# -- 2. second token ------------------------------------------------------------------------------


def second_token(args, backend: str, router: str) -> list[dict]:
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
        start, arrivals, timings = time.perf_counter(), [], None
        for message in stub.Generate(request, timeout=600):
            arrivals += [time.perf_counter() - start] * len(message.token_ids)
            if message.finish_reason:
                timings = message.timings
        rows.append(
            {
                "backend": backend,
                "prompt_tokens": num_tokens,
                "first_token_s": arrivals[0],
                "second_token_s": arrivals[1],
                "ttft_s": timings.ttft,
                "kv_transfer_s": timings.kv_transfer,
            }
        )
    return rows


def main() -> None:
    args = parse_args()
    import torch

    torch.set_num_threads(1)
    bandwidth_rows, token_rows = [], []
    for backend in args.backends.split(","):
        process, ready = start_serve(
            args.model,
            "--prefill-threads",
            str(args.threads),
            "--decode-threads",
            str(args.threads),
            "--no-enable-prefix-caching",
            "--kv-transfer-backend",
            backend,
        )
        try:
            prefill = next(s["grpc"] for s in ready["services"] if s["role"] == "prefill")
            bandwidth_rows += bandwidth(args, backend, prefill)
            token_rows += second_token(args, backend, ready["router"])
        finally:
            process.terminate()
            process.wait(timeout=60)
    report(args, bandwidth_rows, token_rows)
    write_result(
        "kv_transfer.py",
        args,
        args.threads,
        {"bandwidth": bandwidth_rows, "second_token": token_rows},
    )


def report(args, bandwidth_rows: list[dict], token_rows: list[dict]) -> None:
    mib = 1024 * 1024
    print(f"\nKV pull, median of {args.trials} (memcpy: the same bytes, in the same run):")
    print("backend        | prompt tokens | KV MiB | MiB/s | memcpy MiB/s | share of memcpy")
    for r in bandwidth_rows:
        print(
            f"{r['backend']:14s} | {r['prompt_tokens']:13d} | {r['bytes'] / mib:6.1f} | "
            f"{r['bytes_per_s'] / mib:5.0f} | {r['memcpy_bytes_per_s'] / mib:12.0f} | "
            f"{r['share_of_memcpy']:.0%}"
            + (
                f" ({r['share_of_bare_grpc']:.0%} of bare grpcio)"
                if "share_of_bare_grpc" in r
                else ""
            )
        )
    print("\nbackend        | prompt tokens | 1st token ms | 2nd token ms | transfer ms")
    for r in token_rows:
        print(
            f"{r['backend']:14s} | {r['prompt_tokens']:13d} | {r['first_token_s'] * 1e3:12.0f} | "
            f"{r['second_token_s'] * 1e3:12.0f} | {r['kv_transfer_s'] * 1e3:11.1f}"
        )


if __name__ == "__main__":
    main()
