"""Decode attention per layer through the C++ paged kernel, and a whole decode step, by batch
and context length.

    python benchmarks/decode_attention.py [--threads 2] [--dtype bfloat16] [--steps]

The kernel alone: `--batches` requests of `--contexts` tokens each, blocks scattered over a
cache, the default model's 9 query heads over 3 KV heads of 64; median microseconds of a call
(one layer) after warm-up. With `--steps`, also the engine's median decode step (the default
model, random prompts of that length, 40 tokens each, the last 30 steps) at the same batches
and contexts. Figures: docs/benchmarks.md ("A tenth sitting").
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def kernel_us(context: int, batch: int, dtype, repeats: int) -> float:
    import torch

    from services.engine.kernels import load_cpu_kernels

    kernel = load_cpu_kernels()
    if kernel is None:
        raise SystemExit("the C++ kernels could not be built here")
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    num_blocks = batch * -(-context // block_size) + 8
    gen = torch.Generator().manual_seed(context + batch)
    k_cache, v_cache = (
        torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
        for _ in "kv"
    )
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    out = torch.empty_like(q)
    order = torch.randperm(num_blocks, generator=gen)
    tables = order[: batch * -(-context // block_size)].view(batch, -1).contiguous()
    lens = torch.full((batch,), context, dtype=torch.long)
    times = []
    for i in range(repeats + 20):
        start = time.perf_counter()
        kernel.paged_decode_attention(out, q, k_cache, v_cache, tables, lens, head_dim**-0.5)
        if i >= 20:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def step_ms(engine, context: int, batch: int) -> float:
    from services.engine.sampling_params import SamplingParams

    rng = random.Random(context * 100 + batch)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for b in range(batch):
        ids = [rng.randrange(100, 40000) for _ in range(context)]
        engine.add_request(ids, params, request_id=f"{context}-{batch}-{b}")
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[-30:]) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--contexts", type=_ints, default=[256, 2048])
    parser.add_argument("--batches", type=_ints, default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--steps", action="store_true", help="also the engine's decode step")
    args = parser.parse_args()

    def run() -> None:  # on a thread of its own: its OpenMP team is the engine thread's
        import torch

        from services.engine.threads import set_thread_threads

        set_thread_threads(args.threads)
        dtype = getattr(torch, args.dtype)
        print(f"{args.dtype}, {args.threads} threads")
        engine = None
        if args.steps:
            from services.engine.config import EngineConfig
            from services.engine.engine import Engine

            engine = Engine(EngineConfig(model="smollm2-135m-instruct", dtype=args.dtype))
        for context in args.contexts:
            for batch in args.batches:
                line = f"  context {context:>5}, batch {batch:>2}: kernel "
                line += f"{kernel_us(context, batch, dtype, args.repeats):.0f} us a layer"
                if engine is not None:
                    line += f"; decode step {step_ms(engine, context, batch):.1f} ms"
                print(line, flush=True)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
