"""TTFT of a burst: N prompts sent at once to an idle server, per system, several bursts.

    python benchmarks/burst_ttft.py --systems pdserve-always,pdserve-colocated,pdserve
    python benchmarks/burst_ttft.py --prompts 4 --input-len 512 --bursts 3 --dtype float32

Starts each system (`serving_systems.start_systems`: `pdserve serve` in the modes of
`PDSERVE_MODES`, or vLLM's CPU server), then per system and burst runs `pdserve bench serve
--request-rate inf` (seed = burst number, 8 output tokens) and prints the burst's TTFT mean, p50
and max. How a scheduler packs queued prompts into steps shows here: packed, every prompt of a
burst waits for all of them; a prompt per step, the first waits for its own. Figures:
docs/benchmarks.md ("An eleventh sitting").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving_systems import bench_dtype, start_systems, stop_systems  # noqa: E402


def burst(url: str, prompts: int, input_len: int, seed: int, warmups: int) -> dict[str, float]:
    """One burst's TTFT figures (milliseconds: mean_ms, p50_ms, max_ms, ...)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "burst.json"
        subprocess.run(
            [sys.executable, "-m", "services.cli.main", "bench", "serve", "--base-url", url,
             "--random-input-len", str(input_len), "--random-output-len", "8",
             "--num-prompts", str(prompts), "--request-rate", "inf", "--seed", str(seed),
             "--num-warmups", str(warmups), "--json", str(out)],
            check=True, capture_output=True,
        )  # fmt: skip
        data = json.loads(out.read_text())
    return dict(data["points"][0]["ttft"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--systems", default="pdserve-always,pdserve-colocated,pdserve")
    parser.add_argument("--prompts", type=int, default=4, help="requests per burst")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument(
        "--vllm-venv", type=Path, default=Path.home() / ".cache" / "pdserve" / "vllm-venv"
    )
    args = parser.parse_args()
    systems = start_systems(args.systems.split(","), args.vllm_venv, bench_dtype(args.dtype))
    try:
        for system in systems:
            for seed in range(1, args.bursts + 1):
                ttft = burst(system.url, args.prompts, args.input_len, seed, 2 if seed == 1 else 0)
                print(
                    f"{system.name:>18} burst {seed}: TTFT mean {ttft['mean_ms']:,.0f} ms, "
                    f"p50 {ttft['p50_ms']:,.0f} ms, max {ttft['max_ms']:,.0f} ms",
                    flush=True,
                )
    finally:
        stop_systems(systems)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
