"""Benchmark points and the rate sweep that finds goodput.

A point sends its requests open-loop at their scheduled times (`arrivals.py`), each as its own
task, at most `max_concurrency` in flight when that is set, and waits for all of them. The sweep
runs points at rising rates; goodput, as DistServe defines it, is the highest rate at which at
least `GOODPUT_ATTAINMENT` of the requests meet every SLO. Past the sweep's knee (the last rate
that passes and the first that fails) it bisects `bisect` more points, so the goodput is known
to within the final gap (`Goodput.resolution`). A point run with `decide=True` stops as soon as
its misses alone put it below that share (the rest are cancelled and count as misses, as
unfinished requests do), since no later result can make it pass.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tqdm import tqdm

from services.bench.arrivals import arrival_times
from services.bench.backends import Send
from services.bench.dataset import BenchRequest
from services.bench.stats import PointStats, RequestResult, Slo, point_stats

GOODPUT_ATTAINMENT = 0.9


@dataclass(frozen=True)
class Point:
    """One point: its figures, every request's result, and the generator's own CPU seconds."""

    stats: PointStats
    results: list[RequestResult]
    generator_cpu_s: float
    stopped_at: float | None = None  # seconds into the point when it was decided (decide=True)


def _decided(misses: int, total: int) -> bool:
    """Whether `misses` of `total` requests already put the point below GOODPUT_ATTAINMENT."""
    return (total - misses) / total < GOODPUT_ATTAINMENT


async def run_point(
    send: Send,
    requests: Sequence[BenchRequest],
    request_rate: float,
    slo: Slo,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    progress: bool = True,
    decide: bool = False,
) -> Point:
    """Send `requests` at `request_rate` (req/s; inf: all at once) and time them. With `decide`,
    stop once the requests that missed `slo` make the point fail whatever the rest do: the
    requests not yet finished are cancelled (their connections closed, so the server aborts
    them) and recorded as unfinished ("not run: the point failed early")."""
    offsets = arrival_times(len(requests), request_rate, burstiness, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc=f"{request_rate:g} req/s", disable=not progress)
    cpu0, start = time.process_time(), time.perf_counter()
    misses = 0
    failed = asyncio.Event()

    async def one(request: BenchRequest, offset: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        if limit is not None:
            await limit.acquire()
        try:
            sent = time.perf_counter() - start
            result = await send(request)
            result.send_time = sent
            if decide and not slo.met(result):
                nonlocal misses
                misses += 1
                if _decided(misses, len(requests)):
                    failed.set()
            return result
        finally:
            if limit is not None:
                limit.release()
            bar.update()

    tasks = [asyncio.ensure_future(one(r, t)) for r, t in zip(requests, offsets, strict=True)]
    stopped_at = None
    try:
        decided = asyncio.ensure_future(failed.wait())
        finished = asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.wait([decided, finished], return_when=asyncio.FIRST_COMPLETED)  # type: ignore[type-var]
        decided.cancel()
        if failed.is_set():
            stopped_at = time.perf_counter() - start
        for task in tasks:
            task.cancel()
        await finished
    finally:
        bar.close()
    results = [
        task.result()
        if not task.cancelled()
        else RequestResult(
            error="not run: the point failed early",
            prompt_len=request.prompt_len,
            output_len=request.output_len,
            send_time=min(offset, stopped_at or offset),
        )
        for task, request, offset in zip(tasks, requests, offsets, strict=True)
    ]
    cpu = time.process_time() - cpu0
    return Point(point_stats(results, request_rate, slo), results, cpu, stopped_at)


@dataclass(frozen=True)
class Goodput:
    """The highest rate that passed (None: none did), and the gap to the lowest that failed
    above it (None: none failed)."""

    rate: float | None
    resolution: float | None


class Rated(Protocol):
    """What goodput needs of a point: `PointStats`, or any record of rate and attainment."""

    @property
    def request_rate(self) -> float: ...

    @property
    def attainment(self) -> float | None: ...


def goodput(points: Sequence[Rated], threshold: float = GOODPUT_ATTAINMENT) -> Goodput:
    """Goodput from the points run: the highest passing rate below the lowest failing one."""
    failing = [p.request_rate for p in points if (p.attainment or 0.0) < threshold]
    ceiling = min(failing) if failing else None
    passing = [
        p.request_rate
        for p in points
        if (p.attainment or 0.0) >= threshold and (ceiling is None or p.request_rate < ceiling)
    ]
    best = max(passing) if passing else None
    if best is None or ceiling is None:
        return Goodput(best, None)
    return Goodput(best, ceiling - best)


async def sweep(
    run: Callable[[float], Awaitable[Point]],
    rates: Sequence[float],
    bisect: int = 0,
) -> list[Point]:
    """Points at each of `rates` (ascending), then `bisect` points between the knee's two rates.
    `run(rate)` is a coroutine function returning the Point."""
    points: list[Point] = []
    for rate in sorted(rates):
        points.append(await run(rate))
    for _ in range(bisect):
        found = goodput([p.stats for p in points])
        if found.rate is None or found.resolution is None:
            break
        points.append(await run(found.rate + found.resolution / 2))
    return sorted(points, key=lambda p: p.stats.request_rate)
