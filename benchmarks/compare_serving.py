"""Serving comparison: vLLM's CPU OpenAI server, `pdserve serve` with its defaults, and pdserve
colocated (`--disaggregation never --num-prefill 0`), on the same cores, dtype (`--dtype`; auto:
bfloat16 where the CPU has native bf16, float32 where it would emulate it) and model, driven by
`pdserve bench serve`'s load generator over the OpenAI streaming API.

    python benchmarks/compare_serving.py                 # ~1 hour; installs vLLM if missing
    python benchmarks/compare_serving.py --quick         # a few minutes: the protocol, small

Protocol (issue 15):
- vLLM's CPU build lives in its own venv (docs/benchmarks.md's recipe; `--vllm-venv`), installed
  on first use. All three servers run at once, each pinned to the machine's CPUs as its own
  placement does, and only one is under load at any moment.
- Every server is warmed up first (vLLM's compile is excluded: it happens at its start): a
  discarded burst of `--warmup` requests covering the sweep's batch sizes and lengths.
- The same seeded arrival schedule for every system; the systems alternate point by point.
- Every request is checked: no cached prompt token (vLLM runs with
  `--enable-prompt-tokens-details`) and its full output length; a point with either problem is
  reported, never silently kept.
- Recorded with every point: load average, CPU model, the generator's own CPU seconds.
- Goodput: the sweep over `--rates`, then `--bisect` points per system across its knee (below
  the lowest rate when even that one fails), so it is known to within the final gap.
- `--repeats` times (default 3) for the 1 req/s point and both sides of each system's knee
  (`repeat_plan`); `compare_report.py` gives the median ratio to vLLM and its range, and a
  target is met only if the worst repeat meets it.

`--workload W1|W2|W3|W4|U` runs one sitting of issue 32's workload suite instead
(`benchmarks/suite.py`, `benchmarks/workloads.py`).

Also here: the interference run (4 steady streams of 128-token prompts and 256 output tokens;
2,048-token prompts with 8 output tokens every 3 s, for `--interference-s` seconds) and the
crossover benchmark behind `--max-local-prefill-tokens` (`crossover.py`).
Results: benchmarks/results/compare_serving.json, the plot next to it, docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.compare_report import repeat_goodput  # noqa: E402
from benchmarks.interference import interference  # noqa: E402
from benchmarks.serving_systems import (  # noqa: E402
    System,
    bench_dtype,
    start_systems,
    stop_systems,
)
from services.bench.backends import Target, http_sender  # noqa: E402
from services.bench.command import machine  # noqa: E402
from services.bench.dataset import Lengths, make_requests  # noqa: E402
from services.bench.report import plot  # noqa: E402
from services.bench.stats import Slo  # noqa: E402
from services.bench.sweep import run_point  # noqa: E402

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
    systems: list[System], plan: dict[str, list[float]], args: argparse.Namespace, repeat: int
) -> dict[str, list[dict]]:
    """One pass: each system's rates in `plan`, the systems alternating at each rate."""
    import aiohttp

    tokenizer = systems[0].tokenizer
    lengths = Lengths("random", args.input_len, args.output_len)
    out: dict[str, list[dict]] = {s.name: [] for s in systems}
    timeout = aiohttp.ClientTimeout(total=600)
    rates = sorted({r for name in plan for r in plan[name]})
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        for rate in rates:
            for system in (s for s in systems if rate in plan[s.name]):
                send = http_sender(Target(base_url=system.url, model=system.model), session)
                requests = make_requests(
                    tokenizer.encode, tokenizer.decode, args.num_prompts, lengths, seed=repeat
                )
                point = await run_point(send, requests, rate, SLO, seed=repeat, progress=False)
                summary = _point_summary(point)
                if repeat == 0 and math.isclose(rate, 1.0):  # the latency CDFs' point
                    summary["requests"] = [dataclasses.asdict(r) for r in point.results]
                out[system.name].append(summary)
                print(f"  repeat {repeat} {system.name:>18}: {_line(summary)}", flush=True)
    return out


def _line(summary: dict[str, Any]) -> str:
    """A point's progress line (a point where nothing completed has no p50s)."""

    def ms(key: str) -> str:
        return "-" if summary[key] is None else f"{summary[key]:.1f} ms"

    return (
        f"{summary['request_rate']:g} req/s: attainment {summary['attainment'] or 0:.0%}, "
        f"TTFT p50 {ms('ttft_p50_ms')}, TPOT p50 {ms('tpot_p50_ms')}, "
        f"got {summary['achieved_rps']:.2f} req/s, failed {summary['failed']}, "
        f"problems {summary['problems']}"
    )


def repeat_plan(points: list[dict]) -> list[float]:
    """The rates a later repeat runs for one system, from its first repeat's points: 1 req/s
    and both sides of its goodput's knee (the passing rate and the failing one above it)."""
    found = repeat_goodput(points)
    return sorted({1.0, *(r for r in (found.rate, found.above) if r is not None)})


def _next_rate(points: list[dict], floor: float) -> float | None:
    """Where to refine a system's goodput next: halfway across its knee, or, when even the
    lowest rate failed but met at least half its requests, half that rate (not below `floor`);
    None otherwise (a system far below 90% at the lowest rate is not chased down: each halving
    doubles a point's length)."""
    found = repeat_goodput(points)
    if found.rate is not None and found.above is not None:
        return (found.rate + found.above) / 2
    lowest = min(points, key=lambda p: p["request_rate"])
    if found.rate is None and (lowest["attainment"] or 0.0) >= 0.5:
        rate = lowest["request_rate"] / 2
        return rate if rate >= floor else None
    return None


async def _refine(
    systems: list[System], first: dict[str, list[dict]], args: argparse.Namespace
) -> None:
    """`args.bisect` rounds of one point per system at its `_next_rate`, added to `first`."""
    for _ in range(args.bisect):
        plan: dict[str, list[float]] = {s.name: [] for s in systems}
        for s in systems:
            if (rate := _next_rate(first[s.name], floor=0.125)) is not None:
                plan[s.name] = [rate]
        if not any(plan.values()):
            return
        for name, points in (await _run_points(systems, plan, args, repeat=0)).items():
            first[name].extend(points)


async def _warm(systems: list[System], args: argparse.Namespace) -> None:
    import aiohttp

    lengths = Lengths("random", args.input_len, args.output_len)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for system in systems:
            send = http_sender(Target(base_url=system.url, model=system.model), session)
            tok = system.tokenizer
            burst = make_requests(tok.encode, tok.decode, args.warmup, lengths, seed=99)
            await run_point(send, burst, float("inf"), SLO, progress=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="0.5,1,1.5,2,3,4", help="the sweep's rates (req/s)")
    parser.add_argument("--num-prompts", type=int, default=128, help="requests per point")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--bisect", type=int, default=1, help="points per system refining its goodput"
    )
    parser.add_argument("--warmup", type=int, default=48, help="discarded burst per server")
    parser.add_argument("--interference-s", type=float, default=66.0)
    parser.add_argument(
        "--interference-only",
        action="store_true",
        help="run only the interference diagnostic on --systems (no rate sweep)",
    )
    parser.add_argument("--systems", default="vllm,pdserve,pdserve-colocated")
    parser.add_argument(
        "--vllm-venv", default=str(Path.home() / ".cache" / "pdserve" / "vllm-venv")
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="every system's dtype (auto: bfloat16 with native bf16 dot products, else float32)",
    )
    parser.add_argument("--quick", action="store_true", help="small and short: checks the protocol")
    parser.add_argument("--json", default=None, help="default: results/compare_serving.json")
    suite = parser.add_argument_group("the workload suite (benchmarks/suite.py)")
    suite.add_argument(
        "--workload", choices=("W1", "W2", "W3", "W4", "U"), help="run one sitting of the suite"
    )
    suite.add_argument(
        "--rows",
        default="",
        help="the suite's rows to run, comma-separated (default: all; vllm always runs)",
    )
    suite.add_argument(
        "--unloaded", type=int, default=10, help="requests per length measuring T0 and P0"
    )
    suite.add_argument(
        "--vllm-budgets",
        type=lambda text: [int(b) for b in text.split(",")],
        default=[256, 512, 2048],
        help="vLLM --max-num-batched-tokens tried in the pre-pass (one value: no pre-pass)",
    )
    suite.add_argument(
        "--step-logs",
        default=None,
        help="a folder for pdserve's engine step logs (the cost model's live check)",
    )
    args = parser.parse_args()
    args.dtype = bench_dtype(args.dtype)
    if args.workload:
        from benchmarks import suite

        if args.quick:
            args.repeats, args.warmup, args.unloaded = 1, 4, 3
            args.num_prompts = (
                12 if args.num_prompts == parser.get_default("num_prompts") else args.num_prompts
            )
            args.vllm_budgets = args.vllm_budgets[-1:]
        return suite.run(args)
    args.json = args.json or str(RESULTS / "compare_serving.json")
    if args.quick:
        args.rates, args.num_prompts, args.repeats, args.warmup = "1,4", 16, 2, 8
        args.bisect = 1
        args.interference_s = 12.0
    rates = [float(r) for r in args.rates.split(",")]
    systems = start_systems(
        args.systems.split(","), Path(args.vllm_venv), args.dtype, args.step_logs
    )
    if args.interference_only:
        return _interference_only(systems, args)
    try:
        asyncio.run(_warm(systems, args))
        runs = [asyncio.run(_run_points(systems, {s.name: rates for s in systems}, args, 0))]
        asyncio.run(_refine(systems, runs[0], args))
        _save(args, runs, {})
        plan = {name: repeat_plan(points) for name, points in runs[0].items()}
        for repeat in range(1, args.repeats):
            runs.append(asyncio.run(_run_points(systems, plan, args, repeat)))
            _save(args, runs, {})
        inter = _interference_each(systems, args)
    finally:
        stop_systems(systems)
    data = _save(args, runs, inter)
    plot(
        {name: {"points": points} for name, points in runs[0].items()},
        Path(args.json).with_suffix(".png"),
        cdf_at=1.0,
    )
    print(json.dumps({"goodput": data["goodput"]}, indent=1))
    print(f"tables: python benchmarks/compare_report.py {args.json}")
    return 0


def _interference_each(systems: list[System], args: argparse.Namespace) -> dict[str, Any]:
    """The interference diagnostic on each system in turn, by name (each printed as it ends)."""
    inter = {}
    for s in systems:
        inter[s.name] = asyncio.run(interference(s.url, s.model, s.tokenizer, args.interference_s))
        print(s.name, json.dumps(inter[s.name]), flush=True)
    return inter


def _interference_only(systems: list[System], args: argparse.Namespace) -> int:
    """The interference diagnostic alone, each system in turn after its warm-up; its JSON goes to
    `args.json` (the same "interference" key as a full run's)."""
    try:
        asyncio.run(_warm(systems, args))
        inter = _interference_each(systems, args)
    finally:
        stop_systems(systems)
    data = {"config": vars(args), "machine": machine(), "interference": inter}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    print(f"tables: python benchmarks/compare_report.py {args.json}")
    return 0


def _save(
    args: argparse.Namespace, runs: list[dict[str, list[dict]]], inter: dict[str, Any]
) -> dict[str, Any]:
    """Write the JSON so far (after every pass: a crash late in an hour's run keeps the rest)."""
    data = {"config": vars(args), "machine": machine(), "runs": runs, "interference": inter}
    found = {name: [repeat_goodput(run[name]) for run in runs] for name in runs[0]}
    data["goodput"] = {name: [g.rate for g in per_repeat] for name, per_repeat in found.items()}
    data["goodput_resolution"] = {
        name: None if g.rate is None or g.above is None else g.above - g.rate
        for name, (g, *_) in found.items()
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    return data


if __name__ == "__main__":
    sys.exit(main())
