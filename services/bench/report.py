"""A benchmark's output: a printed table per point, the JSON of the run, and PNG plots (latency
CDFs per point; SLO attainment against rate, one line per system)."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from services.bench.stats import PointStats, RequestResult, Summary
from services.bench.sweep import Goodput, Point

METRICS = ("ttft", "tpot", "itl", "e2e")


def point_json(point: Point) -> dict[str, Any]:
    """A point as JSON: its figures (ms), every request's timeline, the generator's CPU time."""
    stats = point.stats
    out: dict[str, Any] = {
        f.name: getattr(stats, f.name)
        for f in dataclasses.fields(stats)
        if not isinstance(getattr(stats, f.name), Summary) and f.name not in METRICS
    }
    for name in METRICS:
        summary = getattr(stats, name)
        out[name] = summary.as_ms() if summary is not None else None
    out["generator_cpu_s"] = point.generator_cpu_s
    out["requests"] = [dataclasses.asdict(r) for r in point.results]
    return out


def run_json(config: dict[str, Any], points: Sequence[Point], found: Goodput) -> dict[str, Any]:
    return {
        "config": config,
        "goodput": {"request_rate": found.rate, "resolution": found.resolution},
        "points": [point_json(p) for p in points],
    }


def print_points(
    points: Sequence[PointStats], found: Goodput, console: Console | None = None
) -> None:
    """One row per point: rate, achieved throughput, attainment, and p50 / p90 / p99 (or max)
    of TTFT, TPOT, ITL and E2E in milliseconds."""
    # A pipe or a log gets the whole table too (rich would cut it to 80 columns).
    console = console or Console(width=None if sys.stdout.isatty() else 200)
    table = Table(title="pdserve bench serve")
    for column in ("req/s", "done", "failed", "req/s got", "tok/s", "SLO met"):
        table.add_column(column, justify="right")
    for name in METRICS:
        table.add_column(f"{name.upper()} p50/p90/p99 ms", justify="right")
    for p in points:
        row = [
            f"{p.request_rate:g}",
            str(p.completed),
            str(p.failed),
            f"{p.request_throughput:.2f}",
            f"{p.output_throughput:.1f}",
            "-" if p.attainment is None else f"{p.attainment:.0%}",
        ]
        for name in METRICS:
            s = getattr(p, name)
            tail = "max" if s is not None and s.p99_is_max else ""
            row.append(
                "-" if s is None else f"{s.p50 * 1e3:.0f}/{s.p90 * 1e3:.0f}/{s.p99 * 1e3:.0f}{tail}"
            )
        table.add_row(*row)
    console.print(table)
    for p in points:
        for error, count in sorted(p.errors.items()):
            console.print(f"{p.request_rate:g} req/s: {count} x {error}")
    if found.rate is not None or any(p.attainment is not None for p in points):
        within = f" (within {found.resolution:.3g} req/s)" if found.resolution else ""
        console.print(f"goodput: {found.rate if found.rate is not None else 'none'} req/s{within}")


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def plot(runs: dict[str, dict[str, Any]], path: str | Path, cdf_at: float | None = None) -> None:
    """PNG at `path`: SLO attainment against request rate (one line per system of `runs`, each a
    `run_json`), and the CDFs of TTFT and TPOT at each system's point of rate `cdf_at` (req/s;
    else its first point that kept its requests; none: no CDF for that system)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rate, ax_ttft, ax_tpot) = plt.subplots(1, 3, figsize=(15, 4.2))
    for label, run in runs.items():
        points = sorted(
            (p for p in run["points"] if p["attainment"] is not None),
            key=lambda p: p["request_rate"],
        )
        ax_rate.plot(
            [p["request_rate"] for p in points],
            [100 * p["attainment"] for p in points],
            marker="o",
            label=label,
        )
        kept = [p for p in run["points"] if "requests" in p]
        at = [p for p in kept if cdf_at is not None and abs(p["request_rate"] - cdf_at) < 1e-6]
        first: dict[str, Any] = at[0] if at else kept[0] if kept else {"requests": []}
        for ax, name in ((ax_ttft, "ttft"), (ax_tpot, "tpot")):
            values = sorted(_values(first["requests"], name))
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.plot([v * 1e3 for v in values], ys, label=f"{label} @ {first['request_rate']:g}")
    ax_rate.axhline(90, color="grey", linestyle=":")
    ax_rate.set(xlabel="request rate (req/s)", ylabel="requests meeting both SLOs (%)")
    ax_ttft.set(xlabel="TTFT (ms)", ylabel="CDF")
    ax_tpot.set(xlabel="TPOT (ms)", ylabel="CDF")
    for ax in (ax_rate, ax_ttft, ax_tpot):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _values(requests: list[dict[str, Any]], name: str) -> list[float]:
    """TTFT or TPOT of the complete requests of a point's JSON."""
    results = [RequestResult(**r) for r in requests]
    if name == "ttft":
        return [r.ttft for r in results if r.complete]
    return [t for r in results if r.complete and (t := r.tpot) is not None]
