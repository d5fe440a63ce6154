"""pdserve's suite rows at one rate, against a sitting's objectives: an A/B of a change to the
adaptive rule without rerunning the sitting.

    python benchmarks/suite_ab.py benchmarks/results/suite_W1_2026-12-07.json 0.72 150
    python benchmarks/suite_ab.py SITTING.json 0.45 150 --rows pdserve-colocated,pdserve

One `pdserve serve` per system the rows need (this checkout's code, the sitting's dtype); by
default the row given the workload's objectives as headers, then the row with pdserve's
default objectives (`--rows`: any of the suite's rows; vLLM with its default settings, no
pre-pass), each at `RATE` req/s
for `COUNT` requests of the sitting's workload (seed 0, as the sitting's repeat 0), run to the
end. Prints each row's attainment, latencies and the paths its requests took; writes
benchmarks/results/suite_ab_<workload>_<rate>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving_systems import bench_dtype, start_systems, stop_systems  # noqa: E402
from benchmarks.suite import RESULTS, ROWS, Sitting, summary  # noqa: E402
from benchmarks.workloads import SUITE  # noqa: E402
from services.bench.stats import Slo  # noqa: E402

FIGURES = ("request_rate", "attainment", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms")


def main() -> int:
    import aiohttp

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sitting", type=Path, help="a sitting's JSON (its workload, objectives)")
    parser.add_argument("rate", type=float, help="req/s")
    parser.add_argument("count", type=int, help="requests per row")
    parser.add_argument(
        "--rows",
        default="pdserve,pdserve-default-objectives",
        help="the suite's rows to run, comma-separated (vllm: its default settings)",
    )
    parser.add_argument("--json", type=Path, default=None, help="default: results/suite_ab_...")
    parser.add_argument(
        "--keep-requests", action="store_true", help="every request's timeline in the JSON too"
    )
    args = parser.parse_args()
    sitting_data = json.loads(args.sitting.read_text())
    objectives = sitting_data["objectives"]
    slo = Slo(
        ttft=objectives["ttft"], tpot=objectives["tpot"], e2e=objectives["e2e"],
        itl=objectives["itl"], ttft_at=tuple(tuple(pair) for pair in objectives["ttft_at"]),
    )  # fmt: skip
    workload = SUITE[sitting_data["config"]["workload"]]
    dtype = bench_dtype(sitting_data["config"]["dtype"])
    asked = args.rows.split(",")
    rows = [row for row in ROWS if row.name in asked]
    if len(rows) != len(asked):
        parser.error(f"--rows: {args.rows!r} names a row that is not one of the suite's")
    names = sorted({row.system for row in rows}, key=lambda n: (n != "vllm", n))
    systems = start_systems(names, Path(sitting_data["config"]["vllm_venv"]), dtype)
    out: dict[str, dict] = {}

    async def run() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            sitting = Sitting(systems, workload, session)
            await sitting.warm(4)
            for row in rows:
                point = await sitting.point(row, args.rate, slo, args.count, seed=0, decide=False)
                found = summary(point)
                paths = Counter(
                    f"{(r.get('timings') or {}).get('path')}/"
                    f"{(r.get('timings') or {}).get('path_reason')}"
                    for r in (found["requests"] if args.keep_requests else found.pop("requests"))
                )
                found["paths"] = dict(paths)
                out[row.name] = found
                print(row.name, {k: found[k] for k in FIGURES}, found["paths"], flush=True)

    try:
        asyncio.run(run())
    finally:
        stop_systems(systems)
    name = f"suite_ab_{sitting_data['config']['workload']}_{args.rate}.json"
    (args.json or RESULTS / name).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
