"""One sitting of the serving suite (issue 32): one workload of `workloads.SUITE`, run side by
side on vLLM's CPU server, pdserve colocated, pdserve's fixed 1+1 split, and pdserve's default
(adaptive) mode given the workload's objectives (as x-slo-* headers) and with its own defaults.

    python benchmarks/compare_serving.py --workload W1            # a sitting: hours
    python benchmarks/compare_serving.py --workload W1 --quick    # the protocol, minutes

The sitting, in order:
1. T0 and P0: vLLM (default settings) unloaded, `--unloaded` requests per prompt length sent one
   at a time; the workload's objectives follow from them (`Workload.objectives`). Every other
   system's unloaded TTFT is measured the same way, for its search's start.
2. vLLM's `--max-num-batched-tokens` from a one-rate pre-pass over `--vllm-budgets` at the
   predicted knee (vLLM restarted for each; the best attainment wins, then the lower TTFT p90).
3. The rate search, per row (`workloads.next_rate`): from the knee predicted by pdserve's fitted
   step costs and the row's unloaded TTFT (`workloads.predicted_knee`), the rows alternating
   point by point, each point `workloads.point_requests` long, or stopped as soon as its misses
   decide that it fails (`run_point(decide=True)`: the rest count as misses).
4. `--repeats` paired repeats: every row again at both rates of its knee, the rows alternating.
Results: benchmarks/results/suite_<workload>.json (and its plot); tables via
`compare_report.py --suite`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks.serving_systems import (
    MODEL,
    System,
    restart_vllm,
    start_systems,
    stop_systems,
)
from benchmarks.workloads import SUITE, Workload, next_rate, point_requests, predicted_knee
from services.bench.backends import Target, http_sender
from services.bench.command import machine
from services.bench.dataset import Lengths, make_requests
from services.bench.report import plot
from services.bench.stats import Slo
from services.bench.sweep import Point, goodput, run_point

RESULTS = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the suite's table: a running system, sent the objectives as headers or not."""

    name: str
    system: str
    objectives: bool = False


ROWS = (
    Row("vllm", "vllm"),
    Row("pdserve-colocated", "pdserve-colocated"),
    Row("pdserve-always", "pdserve-always"),
    Row("pdserve", "pdserve", objectives=True),
    Row("pdserve-default-objectives", "pdserve"),
)


def summary(point: Point) -> dict[str, Any]:
    """A point's figures as the JSON keeps them (every request's timeline included)."""
    s = point.stats
    ms = lambda x: None if x is None else x * 1e3  # noqa: E731
    return {
        "request_rate": s.request_rate,
        "num_requests": s.num_requests,
        "attainment": s.attainment,
        "achieved_rps": s.request_throughput,
        "ttft_p50_ms": ms(s.ttft and s.ttft.p50),
        "ttft_p90_ms": ms(s.ttft and s.ttft.p90),
        "tpot_p50_ms": ms(s.tpot and s.tpot.p50),
        "tpot_p90_ms": ms(s.tpot and s.tpot.p90),
        "itl_p99_ms": ms(s.itl and s.itl.p99),
        "errors": s.errors,
        "stopped_at_s": point.stopped_at,
        "cached": sum(1 for r in point.results if r.cached_tokens),
        "generator_cpu_s": point.generator_cpu_s,
        "load_average": os.getloadavg(),
        "requests": [dataclasses.asdict(r) for r in point.results],
    }


class Sitting:
    """The systems of one sitting and how each row sends a point to them."""

    def __init__(self, systems: list[System], workload: Workload, session: Any) -> None:
        self.systems = {s.name: s for s in systems}
        self.workload = workload
        self.session = session
        self.tokenizer = systems[0].tokenizer

    def requests(self, count: int, seed: int, lengths: Lengths | None = None) -> list:
        tok = self.tokenizer
        return make_requests(tok.encode, tok.decode, count, lengths or self.workload.lengths, seed)

    async def point(
        self, row: Row, rate: float, slo: Slo, count: int, seed: int, decide: bool = True
    ) -> Point:
        """`row` at `rate`; with `decide`, stopped once it has missed too many to pass (then one
        request alone waits out the server's aborts before the next point)."""
        system = self.systems[row.system]
        objectives = slo if row.objectives else None
        target = Target(base_url=system.url, model=system.model, objectives=objectives)
        send = http_sender(target, self.session)
        point = await run_point(
            send, self.requests(count, seed), rate, slo, seed=seed, progress=False, decide=decide
        )
        if point.stopped_at is not None:  # its cancelled requests may still be draining
            probe = self.requests(1, 1000 + seed)
            await run_point(send, probe, float("inf"), Slo(), progress=False)
        return point

    async def unloaded(self, system: str, count: int) -> tuple[dict[int, float], float]:
        """`system`'s unloaded TTFT (seconds by prompt length) and TPOT (seconds): medians of
        `count` requests per prompt length, one at a time (vLLM's are T0 and P0)."""
        send = http_sender(Target(base_url=self.systems[system].url, model=MODEL), self.session)
        t0, tpots = {}, []
        for _, prompt, output in self.workload.shapes():
            alone = self.requests(count, 7, Lengths("random", prompt, output))
            point = await run_point(
                send, alone, float("inf"), Slo(), max_concurrency=1, progress=False
            )
            t0[prompt] = statistics.median(r.ttft for r in point.results)
            tpots += [t for r in point.results if (t := r.tpot) is not None]
        return t0, statistics.median(tpots)

    async def warm(self, count: int) -> None:
        for system in self.systems.values():
            send = http_sender(Target(base_url=system.url, model=system.model), self.session)
            await run_point(send, self.requests(count, 99), float("inf"), Slo(), progress=False)


def knee_start(
    workload: Workload, slo: Slo, unloaded_ttft: dict[int, float], p0: float, dtype: str
) -> float:
    """A row's first rate: `predicted_knee` from the row's own unloaded TTFT, on pdserve's saved
    step costs (in `dtype`) at the most threads (without saved costs, on P0 for the decode
    share)."""
    from services.cost_model import store
    from services.engine.loader import model_id, resolve_model

    # the engine's own key (Engine.cost_model_key): the model's name and its content digest
    key = store.CostModelKey(store.machine_id(), dtype, model_id(Path(resolve_model(MODEL))))
    try:
        costs = store.load(key)
    except (OSError, ValueError):
        costs = []
    cost = max(costs, key=lambda c: c.threads) if costs else None
    return predicted_knee(workload, cost, slo, unloaded_ttft, p0)


def knee_rates(points: list[dict[str, Any]]) -> list[float]:
    """The rates a paired repeat runs for one row, from its repeat-0 points: the passing and the
    failing rate of its knee (the one there is, or the lowest rate run when none passed)."""
    found = goodput([SimpleNamespace(**p) for p in points])
    if found.rate is None:
        return [min(p["request_rate"] for p in points)]
    return [found.rate] + ([found.rate + found.resolution] if found.resolution else [])


def _line(row: Row, repeat: int, p: dict[str, Any]) -> str:
    def ms(key: str) -> str:
        return "-" if p[key] is None else f"{p[key]:.0f} ms"

    return (
        f"  r{repeat} {row.name:>26} {p['request_rate']:.3f} req/s: attainment "
        f"{p['attainment'] or 0:.0%}, TTFT p50 {ms('ttft_p50_ms')}, TPOT p50 {ms('tpot_p50_ms')}, "
        f"errors {sum(p['errors'].values())}, cached {p['cached']}"
        + ("" if p.get("stopped_at_s") is None else f", failed at {p['stopped_at_s']:.0f} s")
    )


async def _search(
    sitting: Sitting, rows: list[Row], slo: Slo, starts: dict[str, float],
    counted: Callable[[float], int], save: Callable[[], None], runs: list[dict[str, list[dict]]],
) -> None:  # fmt: skip
    """Repeat 0: each row's rate search from its start, the rows alternating point by point."""
    points = runs[0]
    while True:
        plan = {
            row.name: next_rate([SimpleNamespace(**p) for p in points[row.name]], starts[row.name])
            for row in rows
        }
        if all(rate is None for rate in plan.values()):
            return
        for row in rows:
            if (rate := plan[row.name]) is not None:
                found = summary(await sitting.point(row, rate, slo, counted(rate), seed=0))
                points[row.name].append(found)
                print(_line(row, 0, found), flush=True)
                save()


async def _repeats(
    sitting: Sitting, rows: list[Row], slo: Slo, repeats: int, counted: Callable[[float], int],
    save: Callable[[], None], runs: list[dict[str, list[dict]]],
) -> None:  # fmt: skip
    """Paired repeats: every row at the passing and failing rate of its repeat-0 knee."""
    for repeat in range(1, repeats + 1):
        runs.append({row.name: [] for row in rows})
        for row in rows:
            rates = knee_rates(runs[0][row.name])
            for rate in rates:
                point = summary(await sitting.point(row, rate, slo, counted(rate), seed=repeat))
                runs[repeat][row.name].append(point)
                print(_line(row, repeat, point), flush=True)
                save()


async def _prepass(
    systems: list[System], args: argparse.Namespace, workload: Workload, slo: Slo, rate: float,
    counted: Callable[[float], int],
) -> dict[str, Any]:  # fmt: skip
    """vLLM's --max-num-batched-tokens: one point at `rate` per budget, vLLM restarted for each;
    the chosen one stays running."""
    import aiohttp

    tried: dict[str, Any] = {}
    for budget in args.vllm_budgets:
        restart_vllm(systems, ["--max-num-batched-tokens", str(budget)])
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            sitting = Sitting(systems, workload, session)
            await sitting.warm(args.warmup)
            # run to the end: the budgets are ranked by attainment, failing ones too
            point = summary(await sitting.point(ROWS[0], rate, slo, counted(rate), 50, False))
        point.pop("requests")
        tried[str(budget)] = point
        print(f"  pre-pass vLLM --max-num-batched-tokens {budget}: {_line(ROWS[0], 0, point)}")
    best = max(
        tried,
        key=lambda b: (tried[b]["attainment"] or 0, -(tried[b]["ttft_p90_ms"] or float("inf"))),
    )
    if best != str(args.vllm_budgets[-1]):
        restart_vllm(systems, ["--max-num-batched-tokens", best])
    return {"rate": rate, "points": tried, "chosen": int(best)}


def run(args: argparse.Namespace) -> int:
    """The sitting `args.workload` (compare_serving.py's flags); writes its JSON and plot."""
    import aiohttp

    workload = SUITE[args.workload]
    counted = (lambda rate: args.num_prompts) if args.quick else point_requests
    out = Path(args.json or RESULTS / f"suite_{args.workload}.json")
    asked = set(args.rows.split(",")) if args.rows else {row.name for row in ROWS}
    rows = [row for row in ROWS if row.name in asked | {"vllm"}]
    systems = start_systems(
        sorted({r.system for r in rows}, key=lambda n: n != "vllm"),
        Path(args.vllm_venv),
        args.dtype,
        args.step_logs,
    )
    data: dict[str, Any] = {"workload": dataclasses.asdict(workload), "config": vars(args)}
    data["machine"] = machine()
    runs: list[dict[str, list[dict]]] = [{row.name: [] for row in rows}]

    def save() -> None:
        data["runs"] = runs
        data["goodput"] = {
            row.name: [goodput([SimpleNamespace(**p) for p in r[row.name]]).rate for r in runs]
            for row in rows
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1) + "\n")

    async def main() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            sitting = Sitting(systems, workload, session)
            await sitting.warm(args.warmup)
            unloaded = {s.name: await sitting.unloaded(s.name, args.unloaded) for s in systems}
        t0, p0 = unloaded["vllm"]
        slo = workload.objectives(t0, p0)
        starts = {
            row.name: knee_start(workload, slo, unloaded[row.system][0], p0, args.dtype)
            for row in rows
        }
        data.update(t0_s=t0, p0_s=p0, objectives=dataclasses.asdict(slo), start_rates=starts)
        data["unloaded"] = {name: {"ttft_s": t, "tpot_s": p} for name, (t, p) in unloaded.items()}
        print(f"T0 {t0} s, P0 {p0 * 1e3:.1f} ms; objectives {slo}")
        print("unloaded:", {n: (t, round(p * 1e3, 1)) for n, (t, p) in unloaded.items()})
        print("starts:", {n: round(r, 3) for n, r in starts.items()}, flush=True)
        if len(args.vllm_budgets) > 1:
            data["vllm_prepass"] = await _prepass(
                systems, args, workload, slo, starts["vllm"], counted
            )
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            sitting = Sitting(systems, workload, session)
            await sitting.warm(args.warmup)
            await _search(sitting, rows, slo, starts, counted, save, runs)
            await _repeats(sitting, rows, slo, args.repeats, counted, save, runs)

    try:
        asyncio.run(main())
    finally:
        stop_systems(systems)
    save()
    plot({row.name: {"points": runs[0][row.name]} for row in rows}, out.with_suffix(".png"))
    print(json.dumps({"goodput": data["goodput"]}, indent=1))
    return 0
