"""The router's per-token cost: the OpenAI HTTP stream (uvicorn) against the gRPC Generate
stream, through one router process, in one run.

Fake prefill and decode workers (tests/router/fakes.py, real gRPC on loopback, in this process)
stream `--tokens` tokens per request, one per message, as fast as they can, so the router is
the bottleneck. A `pdserve router` subprocess serves both APIs; `--streams` clients each run
`--rounds` requests against one API, then the other. Printed per API: tokens/s through the
router and router CPU microseconds per token (utime + stime of its process, /proc/PID/stat).

    python benchmarks/router_stream.py [--streams 16] [--rounds 4] [--tokens 256] [--json FILE]
        [--router-repo CHECKOUT]   # e.g. a worktree of an older commit, to compare routers
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.grpc_server import start_service
from services.common.pb import common_pb2, generate_pb2, generate_pb2_grpc, worker_pb2_grpc  # noqa: E402
from tests.router.fakes import FakeDecode, FakePrefill  # noqa: E402

MODEL = "smollm2-135m-instruct"
TEXT = " hello"  # its one token is streamed over and over


def _start_fakes(num_tokens: int) -> tuple[str, str, list]:
    from services.engine.loader import resolve_model
    from services.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(resolve_model(MODEL))
    assert tokenizer is not None
    (token,) = tokenizer.encode(TEXT)
    prefill, decode = FakePrefill(), FakeDecode()
    prefill.reset([token])
    decode.reset([[token]] * (num_tokens - 1))
    p = start_service(
        "prefill",
        [
            (worker_pb2_grpc.add_PrefillServicer_to_server, prefill, "pdserve.v1.Prefill"),
            (worker_pb2_grpc.add_KVTransferServicer_to_server, prefill, "pdserve.v1.KVTransfer"),
        ],
        "127.0.0.1",
        0,
        0,
        max_workers=256,
    )
    prefill.source = p.grpc_address
    d = start_service(
        "decode",
        [(worker_pb2_grpc.add_DecodeServicer_to_server, decode, "pdserve.v1.Decode")],
        "127.0.0.1",
        0,
        0,
        max_workers=256,
    )
    return p.grpc_address, d.grpc_address, [p, d]


def _start_router(prefill: str, decode: str, repo: Path) -> tuple[subprocess.Popen, dict]:
    argv = [sys.executable, "-m", "services.cli.main", "router", "--model", MODEL, "--port", "0"]
    argv += ["--http-port", "0", "--prefill", prefill, "--decode", decode]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=repo, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("ready "):
            return proc, json.loads(line[len("ready ") :])
    raise RuntimeError("router exited before ready")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _grpc_stream(address: str, num_tokens: int) -> int:
    stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(address))
    request = generate_pb2.GenerateRequest(
        text="Hello", sampling=common_pb2.SamplingParams(max_tokens=num_tokens)
    )
    return sum(len(m.token_ids) for m in stub.Generate(request, timeout=120))


def _http_stream(url: str, num_tokens: int) -> int:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = json.dumps(
        {
            "prompt": "Hello",
            "max_tokens": num_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    events = conn.getresponse().read().decode().split("\n\n")
    conn.close()
    assert events[-2] == "data: [DONE]", events[-3:]
    usage = json.loads(events[-3][len("data: ") :])["usage"]
    return usage["completion_tokens"]


def _measure(run, target: str, args, pid: int) -> dict:
    run(target, args.tokens)  # warm-up
    cpu, start = _cpu_seconds(pid), time.perf_counter()
    with ThreadPoolExecutor(args.streams) as pool:
        counts = list(
            pool.map(lambda _: run(target, args.tokens), range(args.streams * args.rounds))
        )
    wall, cpu = time.perf_counter() - start, _cpu_seconds(pid) - cpu
    tokens = sum(counts)
    return {
        "tokens": tokens,
        "seconds": round(wall, 3),
        "tokens_per_s": round(tokens / wall),
        "router_cpu_us_per_token": round(cpu / tokens * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--router-repo",
        type=Path,
        default=Path(__file__).resolve().parents[1],
        help="checkout whose router runs (e.g. a git worktree of an older commit)",
    )
    args = parser.parse_args()
    prefill, decode, services = _start_fakes(args.tokens)
    router, ready = _start_router(prefill, decode, args.router_repo)
    try:
        results = {
            "grpc": _measure(_grpc_stream, ready["grpc"], args, router.pid),
            "http": _measure(_http_stream, ready["http"], args, router.pid),
        }
    finally:
        router.terminate()
        router.wait(30)
        for service in services:
            service.server.stop(0)
    print(f"{'API':6} {'tokens/s':>10} {'router CPU us/token':>20}")
    for api, r in results.items():
        print(f"{api:6} {r['tokens_per_s']:>10} {r['router_cpu_us_per_token']:>20}")
    ratio = results["http"]["router_cpu_us_per_token"] / results["grpc"]["router_cpu_us_per_token"]
    print(f"HTTP / gRPC router CPU per token: {ratio:.2f}")
    if args.json:
        settings = {k: str(v) for k, v in vars(args).items() if k != "json"}
        args.json.write_text(json.dumps({"args": settings, **results}, indent=2))


if __name__ == "__main__":
    main()
