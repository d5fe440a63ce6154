"""The crossover behind `--max-local-prefill-tokens`: when is prefilling on the decode worker
(the local path) better than on the prefill pool (the remote path)?

One `pdserve serve --dtype bfloat16` cluster (its default placement) and two more routers over
its workers (on the router's CPUs), one `--disaggregation never` (every prompt local) and one
`always` (every prompt remote). For each prompt length L, through each router: 4 steady
streams (128-token prompts, 256 output tokens) while an L-token prompt with 8 output tokens
arrives every second, for `--seconds`. Reported per L and path: the L-prompts' TTFT p50 and
the streams' ITL p99 and TPOT p50. The default is the largest L at which the local path's TTFT
is no worse than the remote path's and the streams' ITL p99 under it stays within
`--itl-slack` (default 1.25x) of theirs under the remote path.

    python benchmarks/crossover.py [--lengths 16,32,64,128,256,512] [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.interference import figures, phase  # noqa: E402
from benchmarks.serving_systems import MODEL, start_pdserve  # noqa: E402
from services.bench.backends import Target, http_sender  # noqa: E402
from services.bench.command import machine  # noqa: E402
from services.bench.dataset import Lengths  # noqa: E402
from services.bench.stats import summarize  # noqa: E402
from services.cluster.placement import plan_placement  # noqa: E402
from services.worker.cpus import format_cpus  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def _router(mode: str, prefill: str, decode: str) -> tuple[str, subprocess.Popen]:
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", "router", "--port", "0", "--http-port", "0",
         "--prefill", prefill, "--decode", decode, "--disaggregation", mode,
         "--cpus", format_cpus(plan_placement(sorted(os.sched_getaffinity(0)), 1, 1).router)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
    )  # fmt: skip
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("ready "):
            return json.loads(line[6:])["http"], process
    raise RuntimeError(f"router --disaggregation {mode} exited before ready")


async def _measure(url: str, tokenizer, length: int, seconds: float) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        send = http_sender(Target(base_url=url, model=MODEL), session)
        streams, probes = await phase(
            send, tokenizer, seconds, 4, Lengths("random", 128, 256),
            Lengths("random", length, 8), 1.0, length,
        )  # fmt: skip
    ttft = summarize([r.ttft for r in probes if r.complete])
    return {
        "ttft_p50_ms": ttft.p50 * 1e3 if ttft else None,
        "probes": len(probes),
        "failed": sum(1 for r in probes if not r.complete),
        **{f"streams_{k}": v for k, v in figures(streams).items()},
    }


def choose(rows: list[dict], slack: float) -> int:
    """The largest length at which local is no worse for TTFT and within `slack` on ITL p99."""
    best = 0
    for row in sorted(rows, key=lambda r: r["length"]):
        local, remote = row["local"], row["remote"]
        if (
            local["ttft_p50_ms"] <= remote["ttft_p50_ms"]
            and local["streams_itl_p99_ms"] <= slack * remote["streams_itl_p99_ms"]
        ):
            best = row["length"]
        else:
            break
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="16,32,64,128,256,512")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--itl-slack", type=float, default=1.25)
    parser.add_argument("--json", default=str(RESULTS / "crossover.json"))
    args = parser.parse_args()
    from services.engine.loader import resolve_model
    from services.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(resolve_model(MODEL))
    _, cluster, info = start_pdserve([])
    services = {s["role"]: s["grpc"] for s in info["services"]}
    routers = {}
    try:
        for path, mode in (("local", "never"), ("remote", "always")):
            routers[path] = _router(mode, services["prefill"], services["decode"])
        rows = []
        for length in (int(x) for x in args.lengths.split(",")):
            row: dict = {"length": length}
            for path, (url, _) in routers.items():
                row[path] = asyncio.run(_measure(url, tokenizer, length, args.seconds))
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        for _, process in routers.values():
            process.terminate()
        cluster.terminate()
        cluster.wait(timeout=60)
    chosen = choose(rows, args.itl_slack)
    data = {"config": vars(args), "machine": machine(), "rows": rows, "chosen": chosen}
    Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    print(f"max_local_prefill_tokens: {chosen}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
