"""KV-aware routing against round-robin, in one run, on a real cluster with a Redis prefix index.

Workload: 8 distinct system prompts of ~1,000 tokens (real text), each followed by a short
question never seen before. Two prefill workers (`--num-blocks` sized so one holds about half the
prompts, both together all of them), one decode worker, one router, `--redis-url` on all of them.
For each policy a fresh cluster serves one warm-up pass (each system prompt once), then
`--rounds` passes in a seeded shuffled order, one request at a time. Measured on the shuffled
passes: TTFT (client-side, request sent -> first token) and the prefix-cache hit rate
(sum of usage.cached_tokens / sum of prompt tokens).

    python benchmarks/prefix_routing.py          # ~4 min

Prints a table and writes JSON (default benchmarks/results/prefix_routing.json).
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cluster import start_serve  # noqa: E402 - after the path setup
from prefix_cache import text_ids, timed_request  # noqa: E402
from report import write_result  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=8, help="distinct system prompts")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=6, help="shuffled passes over the prompts")
    parser.add_argument(
        "--num-blocks", type=int, default=260, help="KV blocks per worker (16 tokens each)"
    )
    parser.add_argument(
        "--redis-url", default=None, help="default: a redis-server started on a free port"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results" / "prefix_routing.json")
    )
    return parser.parse_args()


def start_cluster(args, policy: str, redis_url: str) -> tuple[subprocess.Popen, str]:
    process, ready = start_serve(
        args.model,
        "--num-prefill",
        "2",
        "--num-decode",
        "1",
        "--routing",
        policy,
        "--redis-url",
        redis_url,
        "--num-blocks",
        str(args.num_blocks),
        "--prefill-threads",
        "1",
        "--decode-threads",
        "1",
    )
    return process, ready["router"]


def run_policy(
    args, policy: str, redis_url: str, prompts: list[list[int]], order: list[int]
) -> dict:
    import grpc

    from services.common.pb import generate_pb2_grpc

    process, router = start_cluster(args, policy, redis_url)
    try:
        stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(router))
        questions = iter(text_ids(args.model, 12, offset=25000 + 30 * i) for i in range(10_000))
        for prompt in prompts:  # warm-up pass
            timed_request(stub, prompt + next(questions))
        time.sleep(1.0)  # the workers' cache events reach Redis
        ttfts, cached, total = [], 0, 0
        for i in order:
            request = prompts[i] + next(questions)
            ttft, hit = timed_request(stub, request)
            ttfts.append(ttft)
            cached, total = cached + hit, total + len(request)
    finally:
        process.terminate()
        process.wait(timeout=60)
    ttfts.sort()
    return {
        "policy": policy,
        "requests": len(order),
        "ttft_s": ttfts,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
        "hit_rate": cached / total,
    }


def main() -> None:
    args = parse_args()
    server = None
    redis_url = args.redis_url
    if redis_url is None:
        from tests.redis_server import RedisServer

        server = RedisServer()
        server.start()
        redis_url = server.url
    try:
        prompts = [
            text_ids(args.model, args.prompt_tokens, offset=1200 * i) for i in range(args.prompts)
        ]
        order = [i for _ in range(args.rounds) for i in range(args.prompts)]
        random.Random(args.seed).shuffle(order)
        rows = []
        for policy in ("round_robin", "kv"):
            rows.append(run_policy(args, policy, redis_url, prompts, order))
            r = rows[-1]
            print(
                f"  {policy:12s}: TTFT p50 {1000 * r['ttft_p50_s']:7.0f} ms, "
                f"p90 {1000 * r['ttft_p90_s']:7.0f} ms, "
                f"hit rate {100 * r['hit_rate']:5.1f}%",
                flush=True,
            )
    finally:
        if server is not None:
            server.stop()
    rr, kv = rows
    summary = {
        "ttft_p50_ratio": rr["ttft_p50_s"] / kv["ttft_p50_s"],
        "hit_rate_ratio": kv["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf"),
    }
    print(f"\n{'policy':12s} {'TTFT p50':>10s} {'TTFT p90':>10s} {'hit rate':>9s}")
    for r in rows:
        print(
            f"{r['policy']:12s} {1000 * r['ttft_p50_s']:8.0f}ms {1000 * r['ttft_p90_s']:8.0f}ms "
            f"{100 * r['hit_rate']:8.1f}%"
        )
    print(
        f"KV-aware vs round-robin: TTFT p50 {summary['ttft_p50_ratio']:.1f}x lower, "
        f"hit rate {summary['hit_rate_ratio']:.1f}x higher"
    )
    write_result("prefix_routing.py", args, 1, {"rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
