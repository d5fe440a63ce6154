"""Markdown tables and issue 15's target verdicts from a `compare_serving.py` JSON.

    python benchmarks/compare_report.py [benchmarks/results/compare_serving.json]

Each ratio is pdserve's figure over vLLM's from the same repeat; a target is met only if the
worst repeat meets it. Goodput is the highest rate with >= 90% of requests meeting both SLOs;
where no rate passed for a system its goodput is below the lowest rate run, and a ratio against
it is not defined (the table says so rather than guess).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "benchmarks" / "results" / "compare_serving.json"
NAMES = {"vllm": "vLLM", "pdserve": "pdserve", "pdserve-colocated": "pdserve colocated"}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} ms" if value >= 100 else f"{value:.1f} ms"


def sweep_table(data: dict[str, Any]) -> str:
    """Every point of the first repeat (the sweep and its refinement), by rate then system."""
    rows = [
        "| rate (req/s) | system | SLO met | achieved req/s | TTFT p50 / p99 | TPOT p50 / p99 "
        "| failed | cached / short |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    points = [(p, name) for name, pts in data["runs"][0].items() for p in pts]
    order = list(NAMES)
    for p, name in sorted(points, key=lambda x: (x[0]["request_rate"], order.index(x[1]))):
        rows.append(
            f"| {p['request_rate']:g} | {NAMES[name]} | {p['attainment']:.0%} "
            f"| {p['achieved_rps']:.2f} | {_ms(p['ttft_p50_ms'])} / {_ms(p['ttft_p99_ms'])} "
            f"| {_ms(p['tpot_p50_ms'])} / {_ms(p['tpot_p99_ms'])} | {p['failed']} "
            f"| {p['problems']['cached']} / {p['problems']['short']} |"
        )
    return "\n".join(rows)


def goodput_table(data: dict[str, Any]) -> str:
    lowest = min(p["request_rate"] for pts in data["runs"][0].values() for p in pts)
    rows = ["| system | goodput per repeat (req/s) | resolution |", "|---|---|---:|"]
    for name, per_repeat in data["goodput"].items():
        shown = ", ".join(f"{g:g}" if g is not None else f"< {lowest:g}" for g in per_repeat)
        res = data["goodput_resolution"][name]
        rows.append(f"| {NAMES[name]} | {shown} | {'-' if res is None else f'{res:g}'} |")
    return "\n".join(rows)


def _at(run: dict[str, list[dict]], name: str, rate: float) -> dict | None:
    return next((p for p in run[name] if p["request_rate"] == rate), None)


def one_rps_table(data: dict[str, Any]) -> str:
    """1 req/s p50s of every repeat, and each pdserve system's ratio to vLLM's."""
    rows = [
        "| system | TTFT p50 per repeat | TPOT p50 per repeat | SLO met per repeat |",
        "|---|---|---|---|",
    ]
    for name in data["runs"][0]:
        pts = [p for run in data["runs"] if (p := _at(run, name, 1.0))]
        rows.append(
            f"| {NAMES[name]} | {', '.join(_ms(p['ttft_p50_ms']) for p in pts)} "
            f"| {', '.join(_ms(p['tpot_p50_ms']) for p in pts)} "
            f"| {', '.join(format(p['attainment'], '.0%') for p in pts)} |"
        )
    return "\n".join(rows)


LEGS = (
    "router_queue", "tokenize", "prefill_queue", "prefill", "kv_transfer", "decode_queue",
    "first_decode_step",
)  # fmt: skip


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
            f"| {NAMES[name]} | {ttft:.1f} | " + " | ".join(f"{v:.1f}" for v in legs) + " |"
        )
    return "\n".join(rows)


def interference_table(data: dict[str, Any]) -> str:
    rows = [
        "| system | streams' ITL p99 alone → with long prompts | TPOT p50 alone → with "
        "| long prompts (failed) | their TTFT p50 |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, run in data["interference"].items():
        a, w = run["alone"], run["with_long_prompts"]
        rows.append(
            f"| {NAMES[name]} | {_ms(a['itl_p99_ms'])} → {_ms(w['itl_p99_ms'])} "
            f"| {_ms(a['tpot_p50_ms'])} → {_ms(w['tpot_p50_ms'])} "
            f"| {run['long_prompts']} ({run['long_failed']}) "
            f"| {run['long_ttft_p50_ms'] / 1e3:.1f} s |"
        )
    return "\n".join(rows)


def _ratios(data: dict[str, Any], name: str, key: str) -> list[float]:
    out = []
    for run in data["runs"]:
        ours, theirs = _at(run, name, 1.0), _at(run, "vllm", 1.0)
        if ours and theirs and ours[key] and theirs[key]:
            out.append(ours[key] / theirs[key])
    return out


def _verdict(ratios: list[float], bound: float, higher_is_better: bool = False) -> str:
    if not ratios:
        return "not measured"
    worst = min(ratios) if higher_is_better else max(ratios)
    met = worst >= bound if higher_is_better else worst <= bound
    spread = f"median {statistics.median(ratios):.2f}x, range {min(ratios):.2f}-{max(ratios):.2f}x"
    return f"**{'met' if met else 'missed'}** ({spread})"


def targets(data: dict[str, Any], name: str = "pdserve") -> str:
    """Issue 15's targets for `name` (pdserve with its defaults), worst repeat decides."""
    inter, vllm_inter = data["interference"][name], data["interference"]["vllm"]
    own = inter["with_long_prompts"]["itl_p99_ms"] / inter["alone"]["itl_p99_ms"]
    vs = inter["with_long_prompts"]["itl_p99_ms"] / vllm_inter["with_long_prompts"]["itl_p99_ms"]
    itl_met = own <= 2.0 and vs <= 0.5
    good = list(zip(data["goodput"][name], data["goodput"]["vllm"], strict=True))
    if all(ours is None and theirs is None for ours, theirs in good):
        goodput_line = "**not decided**: neither system met 90% at any rate run"
    elif any(ours is None for ours, _ in good):
        goodput_line = "**missed**: in at least one repeat no rate run met 90%"
    elif any(theirs is None for _, theirs in good):
        goodput_line = "**met**: vLLM met 90% at no rate run in some repeat"
    else:
        goodput_line = _verdict([o / t for o, t in good], 1.3, higher_is_better=True)
    long_ratio = inter["long_ttft_p50_ms"] / vllm_inter["long_ttft_p50_ms"]
    lines = [
        f"- Goodput ≥ 1.3x vLLM's: {goodput_line}.",
        f"- Streams' ITL p99 under long prompts ≤ 2x alone and ≤ 0.5x vLLM's: "
        f"**{'met' if itl_met else 'missed'}** ({own:.2f}x alone, {vs:.3f}x vLLM's).",
        *(
            f"- {label} p50 at 1 req/s ≤ 1.0x vLLM's: "
            f"{_verdict(_ratios(data, name, f'{key}_p50_ms'), 1.0)}."
            for label, key in (("TTFT", "ttft"), ("TPOT", "tpot"))
        ),
        f"- Long prompts' TTFT ≤ 1.5x vLLM's: "
        f"**{'met' if long_ratio <= 1.5 else 'missed'}** ({long_ratio:.2f}x).",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    data = json.loads(Path(argv[0] if argv else DEFAULT).read_text())
    m = data["machine"]
    print(
        f"Machine: {m['cpu_model']}, {m['cpus']} CPUs; load average at the end {m['load_average']}."
    )
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
