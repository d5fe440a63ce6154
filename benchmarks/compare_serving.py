"""Serving comparison: vLLM's CPU OpenAI server, `pdserve serve` with its defaults, and pdserve
colocated (`--disaggregation never --num-prefill 0`), on the same cores, dtype (bfloat16) and
model, driven by `pdserve bench serve`'s load generator over the OpenAI streaming API.

    python benchmarks/compare_serving.py                 # ~1 hour; installs vLLM if missing
    python benchmarks/compare_serving.py --quick         # a few minutes: the protocol, small

Protocol (issue 15):
- vLLM's CPU build lives in its own venv (ARCHITECTURE.md's recipe; `--vllm-venv`), installed
  on first use. All three servers run at once, each pinned to the machine's CPUs as its own
  placement does, and only one is under load at any moment.
- Every server is warmed up first (vLLM's compile is excluded: it happens at its start): a
  discarded burst of `--warmup` requests covering the sweep's batch sizes and lengths.
- The same seeded arrival schedule for every system; the systems alternate point by point.
- Every request is checked: no cached prompt token (vLLM runs with
  `--enable-prompt-tokens-details`) and its full output length; a point with either problem is
  reported, never silently kept.
- Recorded with every point: load average, CPU model, the generator's own CPU seconds.
- `--repeats` times (default 3) for the 1 req/s point and the sweep's knee; the table gives
  the median ratio to vLLM and its range, and a target is met only if the worst repeat meets it.

Also here: the interference run (4 steady streams of 128-token prompts and 256 output tokens;
2,048-token prompts with 8 output tokens every 3 s, for `--interference-s` seconds) and the
crossover benchmark behind `--max-local-prefill-tokens` (`crossover.py`).
Results: benchmarks/results/compare_serving.json, the plot next to it, docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.interference import interference  # noqa: E402
from benchmarks.serving_systems import System, start_systems, stop_systems  # noqa: E402
from services.bench.backends import Target, http_sender  # noqa: E402
from services.bench.command import machine  # noqa: E402
from services.bench.dataset import Lengths, make_requests  # noqa: E402
from services.bench.stats import Slo  # noqa: E402
from services.bench.sweep import goodput, run_point  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SLO = Slo.parse(["ttft:500", "tpot:50"])


def _point_summary(point: Any) -> dict[str, Any]:
    s = point.stats
    problems = {
        "cached": sum(1 for r in point.results if r.cached_tokens),
        "short": sum(1 for r in point.results if r.ok and r.output_tokens < r.output_len),
    }
    return {
        "request_rate": s.request_rate,
        "attainment": s.attainment,
        "achieved_rps": s.request_throughput,
        "ttft_p50_ms": s.ttft.p50 * 1e3 if s.ttft else None,
        "ttft_p99_ms": s.ttft.p99 * 1e3 if s.ttft else None,
        "tpot_p50_ms": s.tpot.p50 * 1e3 if s.tpot else None,
        "tpot_p99_ms": s.tpot.p99 * 1e3 if s.tpot else None,
        "itl_p99_ms": s.itl.p99 * 1e3 if s.itl else None,
        "failed": s.failed,
        "errors": s.errors,
        "problems": problems,
        "generator_cpu_s": point.generator_cpu_s,
        "load_average": os.getloadavg(),
    }


async def _run_points(
    systems: list[System], rates: list[float], args: argparse.Namespace, repeat: int
) -> dict[str, list[dict]]:
    """One pass over `rates`, the systems alternating at each rate."""
    import aiohttp

    tokenizer = systems[0].tokenizer
    lengths = Lengths("random", args.input_len, args.output_len)
    out: dict[str, list[dict]] = {s.name: [] for s in systems}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:  # noqa: E501
        for rate in rates:
            for system in systems:
                send = http_sender(Target(base_url=system.url, model=system.model), session)
                requests = make_requests(
                    tokenizer.encode, tokenizer.decode, args.num_prompts, lengths, seed=repeat
                )
                point = await run_point(send, requests, rate, SLO, seed=repeat, progress=False)
                summary = _point_summary(point)
                out[system.name].append(summary)
                print(
                    f"  repeat {repeat} {rate:g} req/s {system.name:>18}: attainment "
                    f"{summary['attainment']:.0%}, TTFT p50 {summary['ttft_p50_ms']:.0f} ms, "
                    f"TPOT p50 {summary['tpot_p50_ms']:.1f} ms, got {summary['achieved_rps']:.2f}"
                    f" req/s, problems {summary['problems']}",
                    flush=True,
                )
    return out


async def _warm(systems: list[System], args: argparse.Namespace) -> None:
    import aiohttp

    lengths = Lengths("random", args.input_len, args.output_len)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for system in systems:
            send = http_sender(Target(base_url=system.url, model=system.model), session)
            tok = system.tokenizer
            burst = make_requests(tok.encode, tok.decode, args.warmup, lengths, seed=99)
            await run_point(send, burst, float("inf"), SLO, progress=False)


def _goodput(points: list[dict]) -> float | None:
    """`sweep.goodput` over a system's point summaries."""
    return goodput([types.SimpleNamespace(**p) for p in points]).rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="1,2,3,4,5,6,8", help="the sweep's rates (req/s)")
    parser.add_argument("--num-prompts", type=int, default=128, help="requests per point")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=48, help="discarded burst per server")
    parser.add_argument("--interference-s", type=float, default=66.0)
    parser.add_argument("--systems", default="vllm,pdserve,pdserve-colocated")
    parser.add_argument(
        "--vllm-venv", default=str(Path.home() / ".cache" / "pdserve" / "vllm-venv")
    )
    parser.add_argument("--quick", action="store_true", help="small and short: checks the protocol")
    parser.add_argument("--json", default=str(RESULTS / "compare_serving.json"))
    args = parser.parse_args()
    if args.quick:
        args.rates, args.num_prompts, args.repeats, args.warmup = "1,4", 16, 1, 8
        args.interference_s = 12.0
    rates = [float(r) for r in args.rates.split(",")]
    systems = start_systems(args.systems.split(","), Path(args.vllm_venv))
    try:
        asyncio.run(_warm(systems, args))
        runs = []
        for repeat in range(args.repeats):
            # the first repeat sweeps every rate; later ones the 1 req/s point and the knee
            if repeat == 0:
                these = rates
            else:
                knees = {g for pts in runs[0].values() if (g := _goodput(pts)) is not None}
                above = {min([r for r in rates if r > k], default=k) for k in knees}
                these = sorted({rates[0], *knees, *above})
            runs.append(asyncio.run(_run_points(systems, these, args, repeat)))
        inter = {
            s.name: asyncio.run(interference(s.url, s.model, s.tokenizer, args.interference_s))
            for s in systems
        }
    finally:
        stop_systems(systems)
    data = {"config": vars(args), "machine": machine(), "runs": runs, "interference": inter}
    data["goodput"] = {name: [_goodput(run[name]) for run in runs] for name in runs[0]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    print(
        json.dumps(
            {
                "goodput": data["goodput"],
                "interference": {
                    k: {m: v for m, v in i.items() if not isinstance(v, list)}
                    for k, i in inter.items()
                },
            },
            indent=1,
        )
    )  # noqa: E501
    return 0


if __name__ == "__main__":
    sys.exit(main())
