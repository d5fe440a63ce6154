"""Markdown tables and issue 15's target verdicts from a `compare_serving.py` JSON.

    python benchmarks/compare_report.py [benchmarks/results/compare_serving.json]

Each ratio is pdserve's figure over vLLM's from the same repeat; a target is met only if every
repeat meets it (a repeat that did not measure it counts as a miss). Goodput (DistServe: the
highest rate with >= 90% of requests meeting both SLOs) is taken per repeat from that repeat's
own points; below the lowest rate run or above the highest passing one it is only a bound, and
a goodput target is "not decided" where the bounds cannot settle it.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.bench.sweep import goodput  # noqa: E402
from services.router.flow.request_stats import LEGS as ROUTER_LEGS  # noqa: E402

DEFAULT = ROOT / "benchmarks" / "results" / "compare_serving.json"
NAMES = {"vllm": "vLLM", "pdserve": "pdserve", "pdserve-colocated": "pdserve colocated"}


def _ms(value: float | None) -> str:
    """Milliseconds to print: '-' when not measured, whole ms from 100 up."""
    if value is None:
        return "-"
    return f"{value:,.0f} ms" if value >= 100 else f"{value:.1f} ms"


def _name(system: str) -> str:
    return NAMES.get(system, system)


def sweep_table(data: dict[str, Any]) -> str:
    """Every point of the first repeat (the sweep and its refinement), by rate then system."""
    rows = [
        "| rate (req/s) | system | SLO met | achieved req/s | TTFT p50 / p99 | TPOT p50 / p99 "
        "| failed | cached / short |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    points = [(p, name) for name, pts in data["runs"][0].items() for p in pts]
    order = list(data["runs"][0])
    for p, name in sorted(points, key=lambda x: (x[0]["request_rate"], order.index(x[1]))):
        rows.append(
            f"| {p['request_rate']:g} | {_name(name)} | {p['attainment']:.0%} "
            f"| {p['achieved_rps']:.2f} | {_ms(p['ttft_p50_ms'])} / {_ms(p['ttft_p99_ms'])} "
            f"| {_ms(p['tpot_p50_ms'])} / {_ms(p['tpot_p99_ms'])} | {p['failed']} "
            f"| {p['problems']['cached']} / {p['problems']['short']} |"
        )
    return "\n".join(rows)


@dataclass(frozen=True)
class RepeatGoodput:
    """One system's goodput in one repeat, from that repeat's points only (req/s): the highest
    passing rate (None: none passed), the lowest failing rate above it (None: none failed, so
    the goodput is at least `rate`), and the lowest rate run there."""

    rate: float | None
    above: float | None
    lowest: float

    def __str__(self) -> str:
        if self.rate is None:
            return f"< {self.lowest:g}"
        if self.above is None:
            return f"≥ {self.rate:g}"
        return f"{self.rate:g} ({self.above:g} failed)"


def repeat_goodput(points: list[dict]) -> RepeatGoodput:
    """`sweep.goodput` over one system's point summaries of one repeat."""
    found = goodput([types.SimpleNamespace(**p) for p in points])
    above = (
        None if found.rate is None or found.resolution is None else found.rate + found.resolution
    )
    return RepeatGoodput(found.rate, above, min(p["request_rate"] for p in points))


def goodput_table(data: dict[str, Any]) -> str:
    """Each system's goodput per repeat, from that repeat's own points."""
    rows = ["| system | " + " | ".join(f"repeat {i}" for i in range(len(data["runs"]))) + " |"]
    rows.append("|---|" + "---:|" * len(data["runs"]))
    for name in data["runs"][0]:
        cells = [str(repeat_goodput(run[name])) for run in data["runs"] if run.get(name)]
        rows.append(f"| {_name(name)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _at(run: dict[str, list[dict]], name: str, rate: float) -> dict | None:
    """`name`'s point at `rate` in one repeat (rates compared to 1e-6 req/s)."""
    return next((p for p in run[name] if math.isclose(p["request_rate"], rate, abs_tol=1e-6)), None)


def one_rps_table(data: dict[str, Any]) -> str:
    """Every system's 1 req/s p50s and attainment, one value per repeat."""
    rows = [
        "| system | TTFT p50 per repeat | TPOT p50 per repeat | SLO met per repeat |",
        "|---|---|---|---|",
    ]
    for name in data["runs"][0]:
        pts = [p for run in data["runs"] if (p := _at(run, name, 1.0))]
        rows.append(
            f"| {_name(name)} | {', '.join(_ms(p['ttft_p50_ms']) for p in pts)} "
            f"| {', '.join(_ms(p['tpot_p50_ms']) for p in pts)} "
            f"| {', '.join(format(p['attainment'], '.0%') for p in pts)} |"
        )
    return "\n".join(rows)


LEGS = tuple(leg for leg in ROUTER_LEGS if leg != "decode")  # the legs before the first token


def legs_table(data: dict[str, Any]) -> str:
    """pdserve's TTFT legs at 1 req/s (first repeat): the median of each, in ms, next to the
    median client-measured TTFT."""
    rows = [
        "| system | client TTFT | " + " | ".join(LEGS) + " |",
        "|---|" + "---:|" * (len(LEGS) + 1),
    ]
    for name in data["runs"][0]:
        point = _at(data["runs"][0], name, 1.0)
        timed = [r for r in (point or {}).get("requests", []) if r["timings"]]
        if not timed:
            continue
        ttft = statistics.median(r["ttft"] for r in timed) * 1e3
        legs = [statistics.median(r["timings"][leg] for r in timed) * 1e3 for leg in LEGS]
        rows.append(
            f"| {_name(name)} | {ttft:.1f} | " + " | ".join(f"{v:.1f}" for v in legs) + " |"
        )
    if len(rows) == 2:
        rows.append("| (no point at 1 req/s kept its requests' timings) |")
    return "\n".join(rows)


def interference_table(data: dict[str, Any]) -> str:
    """The interference run per system: the streams alone and under long prompts."""
    rows = [
        "| system | streams' ITL p99 alone → with long prompts | TPOT p50 alone → with "
        "| long prompts (failed) | their TTFT p50 |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, run in data["interference"].items():
        a, w = run["alone"], run["with_long_prompts"]
        rows.append(
            f"| {_name(name)} | {_ms(a['itl_p99_ms'])} → {_ms(w['itl_p99_ms'])} "
            f"| {_ms(a['tpot_p50_ms'])} → {_ms(w['tpot_p50_ms'])} "
            f"| {run['long_prompts']} ({run['long_failed']}) "
            f"| {_ms(run['long_ttft_p50_ms'])} |"
        )
    return "\n".join(rows)


def _ratios(data: dict[str, Any], name: str, key: str) -> list[float | None]:
    """`name`'s figure over vLLM's at 1 req/s, per repeat (None: not measured in that repeat)."""
    out: list[float | None] = []
    for run in data["runs"]:
        ours, theirs = _at(run, name, 1.0), _at(run, "vllm", 1.0)
        ok = ours and theirs and ours.get(key) and theirs.get(key)
        out.append(ours[key] / theirs[key] if ok else None)  # type: ignore[index]
    return out


def _verdict(ratios: list[float | None], bound: float) -> str:
    """Met only if every repeat was measured and the worst ratio (the highest) is <= `bound`."""
    measured = [r for r in ratios if r is not None]
    if len(measured) < len(ratios):
        return f"**missed**: measured in {len(measured)} of {len(ratios)} repeats"
    worst = max(measured)
    spread = f"median {statistics.median(measured):.2f}x, range {min(measured):.2f}-{worst:.2f}x"
    return f"**{'met' if worst <= bound else 'missed'}** (worst {worst:.3f}x; {spread})"


def _goodput_outcome(ours: RepeatGoodput, theirs: RepeatGoodput, bound: float) -> str:
    """'met', 'missed' or 'undecided' for one repeat: is our goodput >= `bound` x theirs? A
    goodput below the lowest rate run, or above the highest, bounds the ratio on one side only."""
    if ours.rate is None and theirs.rate is None:
        return "undecided"
    if ours.rate is None:  # ours < ours.lowest
        return "missed" if ours.lowest / theirs.rate <= bound else "undecided"  # type: ignore[operator]
    if theirs.rate is None:  # theirs < theirs.lowest
        return "met" if ours.rate / theirs.lowest >= bound else "undecided"
    ratio = ours.rate / theirs.rate
    if ratio < bound:
        return "undecided" if ours.above is None else "missed"  # ours may be higher
    return "undecided" if theirs.above is None else "met"  # theirs may be higher


def _goodput_verdict(data: dict[str, Any], name: str, bound: float = 1.3) -> str:
    per_repeat = [
        _goodput_outcome(repeat_goodput(run[name]), repeat_goodput(run["vllm"]), bound)
        for run in data["runs"]
    ]
    shown = ", ".join(f"repeat {i}: {o}" for i, o in enumerate(per_repeat))
    if "missed" in per_repeat:
        return f"**missed** ({shown})"
    if "undecided" in per_repeat:
        return f"**not decided** ({shown})"
    return f"**met** ({shown})"


def _interference_verdict(inter: dict[str, Any], vllm: dict[str, Any]) -> str:
    alone, loaded = inter["alone"]["itl_p99_ms"], inter["with_long_prompts"]["itl_p99_ms"]
    theirs = vllm["with_long_prompts"]["itl_p99_ms"]
    if not (alone and loaded and theirs):
        return "**missed**: not measured"
    own, vs = loaded / alone, loaded / theirs
    met = own <= 2.0 and vs <= 0.5
    return f"**{'met' if met else 'missed'}** ({own:.2f}x alone, {vs:.3f}x vLLM's)"


def _long_verdict(inter: dict[str, Any], vllm: dict[str, Any], bound: float = 1.5) -> str:
    if inter["long_failed"] or not (inter["long_ttft_p50_ms"] and vllm["long_ttft_p50_ms"]):
        return f"**missed**: {inter['long_failed']} of {inter['long_prompts']} long prompts failed"
    ratio = inter["long_ttft_p50_ms"] / vllm["long_ttft_p50_ms"]
    return f"**{'met' if ratio <= bound else 'missed'}** ({ratio:.2f}x)"


def targets(data: dict[str, Any], name: str = "pdserve") -> str:
    """Issue 15's targets for `name` (pdserve with its defaults), worst repeat decides."""
    inter, vllm_inter = data["interference"][name], data["interference"]["vllm"]
    lines = [
        f"- Goodput ≥ 1.3x vLLM's: {_goodput_verdict(data, name)}.",
        "- Streams' ITL p99 under long prompts ≤ 2x alone and ≤ 0.5x vLLM's: "
        f"{_interference_verdict(inter, vllm_inter)}.",
        *(
            f"- {label} p50 at 1 req/s ≤ 1.0x vLLM's: "
            f"{_verdict(_ratios(data, name, f'{key}_p50_ms'), 1.0)}."
            for label, key in (("TTFT", "ttft"), ("TPOT", "tpot"))
        ),
        f"- Long prompts' TTFT ≤ 1.5x vLLM's: {_long_verdict(inter, vllm_inter)}.",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    data = json.loads(Path(argv[0] if argv else DEFAULT).read_text())
    m = data["machine"]
    print(
        f"Machine: {m['cpu_model']}, {m['cpus']} CPUs; load average at the end {m['load_average']}."
    )
    if "runs" not in data:  # compare_serving.py --interference-only
        print(f"\n**Interference.**\n\n{interference_table(data)}")
        return 0
    for title, table in (
        ("The sweep (first repeat)", sweep_table(data)),
        ("Goodput (TTFT ≤ 500 ms and TPOT ≤ 50 ms for ≥ 90% of requests)", goodput_table(data)),
        ("1 req/s, every repeat", one_rps_table(data)),
        ("pdserve's TTFT legs at 1 req/s, medians in ms", legs_table(data)),
        ("Interference", interference_table(data)),
        ("Targets (pdserve with its defaults)", targets(data)),
    ):
        print(f"\n**{title}.**\n\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
