"""Markdown tables and issue 32's target verdicts from a suite sitting's JSON.

    python benchmarks/suite_report.py benchmarks/results/suite_W1.json

Goodput per row and repeat comes from that repeat's own points (`sweep.goodput`); a ratio pairs
two rows' goodputs of the same repeat. A target is met when the median ratio meets it and the
worst repeat reaches 0.9x of it; a repeat where either goodput is unknown (below the rates run)
leaves the target undecided unless the bounds settle it.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.workloads import SUITE  # noqa: E402
from services.bench.stats import RequestResult, point_stats  # noqa: E402
from services.bench.sweep import goodput  # noqa: E402

TARGETS = {"W1": 1.0, "W2": 1.5, "W3": 2.0, "W4": 1.1}  # pdserve / vLLM goodput
SELF_TARGET = 0.95  # pdserve / the better of its fixed modes, every workload
FIXED = ("pdserve-colocated", "pdserve-always")


def goodputs(data: dict[str, Any], row: str) -> list[float | None]:
    """`row`'s goodput (req/s) in each repeat (None: no rate passed)."""
    return [goodput([SimpleNamespace(**p) for p in run[row]]).rate for run in data["runs"]]


def ratios(data: dict[str, Any], row: str, against: list[str]) -> list[float | None]:
    """Per repeat: `row`'s goodput over the best of `against` rows' (None: not known)."""
    mine = goodputs(data, row)
    theirs = [goodputs(data, name) for name in against]
    out: list[float | None] = []
    for i, value in enumerate(mine):
        known = [v for g in theirs if (v := g[i]) is not None]
        best = max(known) if known else None
        out.append(None if value is None or best is None else value / best)
    return out


def verdict(values: list[float | None], target: float) -> str:
    known = [v for v in values if v is not None]
    if len(known) < len(values) or not known:
        return "not decided (a goodput below the rates run)"
    met = statistics.median(known) >= target and min(known) >= 0.9 * target
    return (
        "met" if met else "missed"
    ) + f" (median {statistics.median(known):.2f}, worst {min(known):.2f})"


def rescored(data: dict[str, Any], workload: str) -> dict[str, Any]:
    """The sitting `data` scored by another workload's objectives on the same requests (W3 on a
    W2 sitting: its mix, plus the gap objective): every point's attainment again from its
    per-request results, with the sitting's own T0 and P0. The rates stay the sitting's, so the
    goodput found is the highest of them that passes, and "< x" where none does. ValueError when
    the prompt mixes differ or a point kept no per-request data."""
    name = data["config"]["workload"]
    if SUITE[name].lengths != SUITE[workload].lengths:
        raise ValueError(f"workload: {workload} does not share {name}'s requests")
    t0 = {int(n): s for n, s in data["t0_s"].items()}
    slo = SUITE[workload].objectives(t0, data["p0_s"])
    runs = []
    for run in data["runs"]:
        rows = {}
        for row, points in run.items():
            rows[row] = []
            for p in points:
                if "requests" not in p:
                    raise ValueError(f"runs: a point of {row} kept no per-request data")
                results = [RequestResult(**r) for r in p["requests"]]
                stats = point_stats(results, p["request_rate"], slo)
                rows[row].append({**p, "attainment": stats.attainment})
        runs.append(rows)
    config = {**data["config"], "workload": workload, "rescored_from": name}
    return {**data, "config": config, "runs": runs}


def knee_latencies(data: dict[str, Any]) -> str:
    rows = [
        "| row | rate | SLO met | TTFT p50 / p90 | TPOT p50 / p90 | ITL p99 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row, points in data["runs"][0].items():
        found = goodput([SimpleNamespace(**p) for p in points])
        at = [p for p in points if found.rate is not None and p["request_rate"] == found.rate]
        for p in at[:1]:
            rows.append(
                f"| {row} | {p['request_rate']:.3f} | {p['attainment']:.0%} "
                f"| {p['ttft_p50_ms']:.0f} / {p['ttft_p90_ms']:.0f} ms "
                f"| {p['tpot_p50_ms']:.1f} / {p['tpot_p90_ms']:.1f} ms | {p['itl_p99_ms']:.0f} ms |"
            )
    return "\n".join(rows)


def report(data: dict[str, Any]) -> str:
    name = data["config"]["workload"]
    lines = [
        f"Sitting {name} on {data['machine']['cpu_model']} ({data['machine']['cpus']} CPUs): "
        f"T0 {', '.join(f'{int(k)}: {v * 1e3:.0f} ms' for k, v in data['t0_s'].items())}, "
        f"P0 {data['p0_s'] * 1e3:.1f} ms; vLLM --max-num-batched-tokens "
        f"{data.get('vllm_prepass', {}).get('chosen', 'default')}",
        "",
        "| row | " + " | ".join(f"repeat {i}" for i in range(len(data["runs"]))) + " |",
        "|---|" + "---:|" * len(data["runs"]),
    ]
    for row in data["runs"][0]:
        lowest = [min((p["request_rate"] for p in run[row]), default=0.0) for run in data["runs"]]
        cells = [
            f"< {low:.3f}" if g is None else f"{g:.3f}"
            for g, low in zip(goodputs(data, row), lowest, strict=True)
        ]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    lines += ["", knee_latencies(data), ""]
    if name in TARGETS:
        vs = ratios(data, "pdserve", ["vllm"])
        lines.append(f"- pdserve / vLLM goodput >= {TARGETS[name]}: {verdict(vs, TARGETS[name])}")
    fixed = [row for row in FIXED if row in data["runs"][0]]  # a sitting may run fewer rows
    if fixed:
        own = ratios(data, "pdserve", fixed)
        lines.append(
            f"- pdserve / best of {', '.join(fixed)} >= {SELF_TARGET}: {verdict(own, SELF_TARGET)}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    # suite_report.py SITTING.json [--as W3]: the sitting, or rescored by another workload
    sitting = json.loads(Path(sys.argv[1]).read_text())
    if len(sys.argv) == 4 and sys.argv[2] == "--as":
        sitting = rescored(sitting, sys.argv[3])
    print(report(sitting))
