"""Prefix caching and chunked prefill on the default model, each against its own baseline.

1. TTFT, cold vs warm, through a real local cluster (router + 1 prefill + 1 decode worker on
   loopback, `pdserve serve`): a 1,000-token shared prefix (a "system prompt" of real text) plus
   a short question the cluster has not seen. Cold: the prefix cache is reset first
   (`Admin.ResetPrefixCache` on the router). Warm: the prefix was served before. TTFT is
   measured by the client: request sent -> first streamed token.
2. Chunked prefill: the memory one 4,096-token prefill adds (peak RSS during the request minus
   RSS just before it, both read from /proc after resetting the peak with clear_refs), with a
   per-step budget of 512 tokens vs one unchunked step, each in a fresh engine process after the
   same 64-token warm-up; and the prefill time each needs (the throughput cost of chunking).

    python benchmarks/prefix_cache.py            # ~3 min
    python benchmarks/prefix_cache.py --trials 3 --prefix-tokens 1000

Prints a table and writes JSON (default benchmarks/results/prefix_cache.json).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument(
        "--trials", type=int, default=5, help="cold and warm requests each (median counts)"
    )
    parser.add_argument(
        "--long-prompt", type=int, default=4096, help="tokens of the chunking prompt"
    )
    parser.add_argument(
        "--chunk", type=int, default=512, help="max_num_batched_tokens when chunked"
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads of every worker / engine"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prefix_cache.json"))
    parser.add_argument(
        "--memory-child", nargs=3, metavar=("MODEL", "TOKENS", "BUDGET"), help=argparse.SUPPRESS
    )
    return parser.parse_args(argv)


def text_ids(model: str, num_tokens: int, offset: int = 0) -> list[int]:
    """`num_tokens` token ids of real English-and-code text (stdlib sources)."""
    import argparse as a  # noqa: E401 - text sources
    import json as j
    import logging

    from transformers import AutoTokenizer

    from services.engine.loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    text = "\n".join(inspect.getsource(m) for m in (logging, a, j.decoder))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) >= offset + num_tokens, len(ids)
    return ids[offset : offset + num_tokens]


# -- 1. TTFT through a cluster -------------------------------------------------------------------


def start_cluster(args) -> tuple[subprocess.Popen, str]:
    from cluster import start_serve

    process, ready = start_serve(
        args.model, "--prefill-threads", str(args.threads), "--decode-threads", str(args.threads)
    )
    return process, ready["router"]


def timed_request(stub, prompt: list[int]) -> tuple[float, int]:
    """(client-side TTFT in seconds, usage.cached_tokens) of one greedy 4-token request."""
    from services.common.pb import common_pb2, generate_pb2

    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    )
    start = time.perf_counter()
    ttft, cached = None, 0
    for msg in stub.Generate(request, timeout=300):
        if ttft is None and msg.token_ids:
            ttft = time.perf_counter() - start
        if msg.finish_reason:
            cached = msg.usage.cached_tokens
    return ttft, cached


def bench_ttft(args) -> dict:
    import grpc

    from services.common.pb import generate_pb2_grpc, worker_pb2, worker_pb2_grpc

    prefix = text_ids(args.model, args.prefix_tokens)
    questions = [
        text_ids(args.model, 12, offset=20000 + 40 * i) for i in range(2 * args.trials + 1)
    ]
    process, router = start_cluster(args)
    try:
        channel = grpc.insecure_channel(router)
        stub = generate_pb2_grpc.GenerationStub(channel)
        admin = worker_pb2_grpc.AdminStub(channel)
        timed_request(stub, questions[-1] + prefix[:64])  # warm the code paths, not the prefix
        cold, warm = [], []
        for i in range(args.trials):
            admin.ResetPrefixCache(worker_pb2.ResetPrefixCacheRequest(), timeout=30)
            cold.append(timed_request(stub, prefix + questions[i]))
        for i in range(args.trials):  # the prefix is cached now; each question is new
            warm.append(timed_request(stub, prefix + questions[args.trials + i]))
    finally:
        process.terminate()
        process.wait(timeout=30)
    cold_ttft = statistics.median(t for t, _ in cold)
    warm_ttft = statistics.median(t for t, _ in warm)
    return {
        "prompt_tokens": len(prefix) + len(questions[0]),
        "cold_ttft_s": [t for t, _ in cold],
        "warm_ttft_s": [t for t, _ in warm],
        "cold_cached_tokens": [c for _, c in cold],
        "warm_cached_tokens": [c for _, c in warm],
        "cold_ttft_median_s": cold_ttft,
        "warm_ttft_median_s": warm_ttft,
        "speedup": cold_ttft / warm_ttft,
    }


# -- 2. chunked prefill: memory and time ---------------------------------------------------------


def _rss_kib(field: str) -> int:
    return int(
        re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)
    )


def memory_child(model: str, num_tokens: int, budget: int) -> dict:
    """Runs in a fresh process: one engine, a 64-token warm-up, then the long prefill twice
    (memory measured on the first, time on both; the cache is reset in between)."""
    import gc

    from services.engine import LLM, Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=model, max_num_batched_tokens=budget, seed=0))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    LLM(engine).generate([text_ids(model, 64, offset=30000)], params)
    prompt = text_ids(model, num_tokens)
    gc.collect()
    before = _rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS from here on
    times = []
    for _ in range(2):
        engine.reset_prefix_cache()
        start = time.perf_counter()
        LLM(engine).generate([prompt], params)
        times.append(time.perf_counter() - start)
        if len(times) == 1:
            peak = _rss_kib("VmHWM")
    steps = -(-num_tokens // budget)
    return {
        "budget": budget,
        "steps": steps,
        "rss_before_bytes": before * 1024,
        "peak_added_bytes": (peak - before) * 1024,
        "prefill_seconds": min(times),
    }


def bench_chunking(args) -> dict:
    results = {}
    for name, budget in (("unchunked", max(8192, args.long_prompt)), ("chunked", args.chunk)):
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        done = subprocess.run(
            [
                sys.executable,
                __file__,
                "--memory-child",
                args.model,
                str(args.long_prompt),
                str(budget),
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=1200,
        )
        if done.returncode != 0:
            raise RuntimeError(f"memory child ({name}) failed:\n{done.stderr[-3000:]}")
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            f"  {name:9s}: +{results[name]['peak_added_bytes'] / 2**20:7.1f} MiB peak, "
            f"{results[name]['prefill_seconds']:.2f} s",
            flush=True,
        )
    unchunked, chunked = results["unchunked"], results["chunked"]
    results["memory_reduction"] = 1 - chunked["peak_added_bytes"] / unchunked["peak_added_bytes"]
    results["time_ratio"] = chunked["prefill_seconds"] / unchunked["prefill_seconds"]
    return results


def main() -> None:
    args = parse_args()
    if args.memory_child:
        model, tokens, budget = args.memory_child
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
        print(json.dumps(memory_child(model, int(tokens), int(budget))))
        return
    print(
        f"TTFT, {args.prefix_tokens}-token shared prefix + a new 12-token question "
        f"({args.trials} each):",
        flush=True,
    )
    ttft = bench_ttft(args)
    print(
        f"  cold {1000 * ttft['cold_ttft_median_s']:.0f} ms, "
        f"warm {1000 * ttft['warm_ttft_median_s']:.0f} ms "
        f"(cached_tokens {ttft['warm_cached_tokens'][0]}): {ttft['speedup']:.1f}x",
        flush=True,
    )
    print(f"{args.long_prompt}-token prefill, budget {args.chunk} vs unchunked:", flush=True)
    chunking = bench_chunking(args)
    print(f"\n{'measure':44s} {'baseline':>12s} {'pdserve':>12s} {'ratio':>8s}")
    print(
        f"{'TTFT median (cold -> warm prefix cache)':44s} "
        f"{1000 * ttft['cold_ttft_median_s']:10.0f}ms "
        f"{1000 * ttft['warm_ttft_median_s']:10.0f}ms {ttft['speedup']:7.1f}x"
    )
    u, c = chunking["unchunked"], chunking["chunked"]
    print(
        f"{'peak memory added (unchunked -> chunked)':44s} "
        f"{u['peak_added_bytes'] / 2**20:10.1f}MiB "
        f"{c['peak_added_bytes'] / 2**20:10.1f}MiB {100 * chunking['memory_reduction']:6.0f}% less"
    )
    print(
        f"{'prefill time (unchunked -> chunked)':44s} {u['prefill_seconds']:11.2f}s "
        f"{c['prefill_seconds']:11.2f}s "
        f"{chunking['time_ratio']:7.2f}x"
    )
    from report import write_result

    write_result(
        "prefix_cache.py",
        args,
        args.threads,
        {"ttft": ttft, "chunking": chunking},
        skip=("memory_child",),
    )


if __name__ == "__main__":
    main()
