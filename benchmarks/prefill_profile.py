"""One prompt's prefill in-process: its median time and a torch.profiler table of one.

    python benchmarks/prefill_profile.py [--tokens 256] [--threads 2] [--dtype bfloat16]

The engine alone (no serving path), on random token ids, `max_tokens` 1: what a served TTFT
would be with no router, transfer or queue. Figures: docs/benchmarks.md ("The workload suite").
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from services.engine.config import EngineConfig
    from services.engine.engine import Engine
    from services.engine.sampling_params import SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model="smollm2-135m-instruct", dtype=args.dtype))
    rng = random.Random(0)

    def prefill(request_id: str) -> float:
        ids = [rng.randrange(100, 40000) for _ in range(args.tokens)]
        start = time.perf_counter()
        params = SamplingParams(max_tokens=1, temperature=0.0)
        engine.add_request(ids, params, request_id=request_id)
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start

    for i in range(3):
        prefill(f"warm-{i}")
    seconds = [prefill(f"run-{i}") for i in range(args.repeats)]
    print(
        f"{args.tokens}-token prefill and its first token, {args.threads} threads, {args.dtype}: "
        f"median {statistics.median(seconds) * 1e3:.1f} ms of {args.repeats}"
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        prefill("profiled")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return 0


if __name__ == "__main__":
    sys.exit(main())
