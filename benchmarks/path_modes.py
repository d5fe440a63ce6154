"""Serving-path rules side by side: one `pdserve serve` per rule, `pdserve bench serve` at each
rate over its gRPC API, then the router's path counters and calibration.

    python benchmarks/path_modes.py predicted,length512 0.5,1.0 256 64 60 "ttft:390 tpot:36" w1
    python benchmarks/path_modes.py predicted 0.15 2048 128 30 "ttft:4140 tpot:36" w2048 \
        --slo-tpot-ms 36

Arguments: rules (comma list of RULES' names), rates (req/s, comma list), prompt tokens, output
tokens, requests per point, the `--goodput` objectives, and a tag naming the JSON files each
point writes (`benchmarks/results/path_modes_TAG_RULE_RATE.json`); what follows goes to every
`pdserve serve` as flags. Figures: docs/benchmarks.md
"Conditional disaggregation by predicted TTFT".
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serving_systems import start_pdserve  # noqa: E402

RULES = {
    "predicted": [],  # serve's default: the lower predicted TTFT
    "length512": ["--max-local-prefill-tokens", "512"],
    "remote": ["--max-local-prefill-tokens", "0"],
    "colocated": ["--disaggregation", "never", "--num-prefill", "0"],
    "fixed": ["--disaggregation", "always"],
}
SERIES = ("pdserve_router_path_decisions_total", "pdserve_router_path_calibration_ratio")


def _bench(router: str, rate: str, args: list[str], out: Path) -> dict:
    inp, outp, n, goodput = args
    command = [
        sys.executable, "-m", "services.cli.main", "bench", "serve", "--grpc", router,
        "--random-input-len", inp, "--random-output-len", outp, "--num-prompts", n,
        "--request-rate", rate, "--num-warmups", "3", "--seed", "1",
        "--goodput", *goodput.split(), "--json", str(out), "--no-progress",
    ]  # fmt: skip
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
    return json.loads(out.read_text())["points"][0]


def _ms(point: dict, key: str) -> str:
    s = point.get(key)
    return "-" if not s else f"{s['p50_ms']:.0f}/{s['p90_ms']:.0f}"


def main() -> int:
    if len(sys.argv) < 8:
        print(__doc__)
        return 2
    rules, rates, *args, tag = sys.argv[1:8]
    results = ROOT / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    for rule in rules.split(","):
        _, process, info = start_pdserve(RULES[rule] + sys.argv[8:])
        try:
            for rate in rates.split(","):
                p = _bench(
                    info["router"], rate, args, results / f"path_modes_{tag}_{rule}_{rate}.json"
                )
                print(
                    f"{rule} {rate} req/s: met {p['attainment']:.0%} TTFT {_ms(p, 'ttft')} "
                    f"TPOT {_ms(p, 'tpot')} ITL {_ms(p, 'itl')} ms (p50/p90), failed {p['failed']}",
                    flush=True,
                )
            router = next(s for s in info["services"] if s["role"] == "router")
            text = urllib.request.urlopen(router["metrics"], timeout=10).read().decode()
            for line in text.splitlines():
                if line.startswith(SERIES) and not line.endswith(" 0.0"):
                    print(" ", line)
        finally:
            process.terminate()
            process.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
