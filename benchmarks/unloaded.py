"""Unloaded TTFT and TPOT of serving systems, measured as a suite sitting measures vLLM's T0 and P0.

    python benchmarks/unloaded.py --workload W4 --systems vllm,pdserve,pdserve-colocated
    python benchmarks/unloaded.py --workload W2 --systems pdserve --rounds 2 --count 10

Starts each system (`serving_systems.start_systems`: vLLM's CPU server, `pdserve serve` in the
modes of `PDSERVE_MODES`; all on this machine's CPUs, `--dtype` for all), warms each up, then per
round and system sends `--count` requests of each of the workload's prompt lengths one at a time
(`Sitting.unloaded`): the median TTFT per length and the median TPOT. Figures:
docs/benchmarks.md ("A tenth sitting").
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving_systems import bench_dtype, start_systems, stop_systems  # noqa: E402
from benchmarks.suite import Sitting  # noqa: E402
from benchmarks.workloads import SUITE  # noqa: E402


def main() -> int:
    import aiohttp

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="W1", choices=sorted(SUITE))
    parser.add_argument("--systems", default="vllm,pdserve,pdserve-colocated")
    parser.add_argument("--count", type=int, default=10, help="requests per prompt length")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument("--warmup", type=int, default=8, help="a discarded burst per system")
    parser.add_argument(
        "--vllm-venv", type=Path, default=Path.home() / ".cache" / "pdserve" / "vllm-venv"
    )
    args = parser.parse_args()
    systems = start_systems(args.systems.split(","), args.vllm_venv, bench_dtype(args.dtype))

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            sitting = Sitting(systems, SUITE[args.workload], session)
            await sitting.warm(args.warmup)
            for round_ in range(args.rounds):
                for system in systems:
                    ttft, tpot = await sitting.unloaded(system.name, args.count)
                    lengths = ", ".join(f"{n}: {s * 1e3:.0f} ms" for n, s in ttft.items())
                    name, tpot_ms = system.name, tpot * 1e3
                    line = f"round {round_} {name:>18}: TTFT {lengths}; TPOT {tpot_ms:.1f} ms"
                    print(line, flush=True)

    try:
        asyncio.run(run())
    finally:
        stop_systems(systems)
    return 0


if __name__ == "__main__":
    sys.exit(main())
