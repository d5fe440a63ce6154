"""docs/observability.md's figures: the dashboard's own queries over a real run, from Prometheus.

    python benchmarks/observability_figures.py [--seconds 90] [--rate 1.5]

Starts a real Prometheus (Debian's binary, the shipped deploy/prometheus/ config) and a
`pdserve serve --prometheus-targets` cluster on the default model, drives it with
`pdserve bench serve` (Poisson arrivals, 256-token prompts, 32 output tokens) while a side thread
sends a few refusals (bad JSON, an unknown model) and cancels, then reads every query of
deploy/grafana/dashboards/pdserve.json over the run from Prometheus's HTTP API
(`/api/v1/query_range`, Grafana's variables substituted as "All" would) and draws one PNG per
dashboard row into docs/observability/ with matplotlib. Nothing is simulated.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from deploy.grafana.panels import slug, substitute  # noqa: E402 - after the path
from tests.prometheus_server import PrometheusServer  # noqa: E402

DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "pdserve.json"
OUT = ROOT / "docs" / "observability"
STEP_S = 5.0


def rows_of(dashboard: dict) -> list[tuple[str, list[dict]]]:
    """[(row title, [panel, ...])] in the dashboard's order."""
    rows: list[tuple[str, list[dict]]] = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            rows.append((panel["title"], []))
        else:
            rows[-1][1].append(panel)
    return rows


TTFT_SLO, TPOT_SLO = "1.0", "0.1"  # the figures' SLOs (choices of the dashboard's)


def legend(fmt: str, labels: dict) -> str:
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()
    return substitute(text, "", TTFT_SLO, TPOT_SLO)


def _side_traffic(http: str, stop: threading.Event) -> None:
    """Every few seconds a refusal of each kind, so the errors panel has lines."""
    bodies = [b"{not json", json.dumps({"prompt": "x", "model": "another"}).encode()]
    while not stop.wait(4.0):
        for body in bodies:
            request = urllib.request.Request(
                http + "/v1/completions", data=body, headers={"content-type": "application/json"}
            )
            try:
                urllib.request.urlopen(request, timeout=10).read()
            except urllib.error.HTTPError:
                pass


def run(seconds: float, rate: float) -> tuple[PrometheusServer, float, float, subprocess.Popen]:
    work = Path(tempfile.mkdtemp(prefix="pdserve-observability-"))
    prometheus = PrometheusServer(work)
    prometheus.start()
    targets = prometheus.targets_dir / "pdserve.json"
    serve = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", "serve", "--port", "0", "--http-port", "0",
         "--prometheus-targets", str(targets)],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert serve.stdout is not None
    ready = next(json.loads(line[6:]) for line in serve.stdout if line.startswith("ready "))
    while len([t for t in prometheus.active_targets() if t["health"] == "up"]) < 3:
        time.sleep(1)
    time.sleep(2 * STEP_S)  # a baseline before the load
    start = time.time()
    stop = threading.Event()
    side = threading.Thread(target=_side_traffic, args=(ready["http"], stop))
    side.start()
    bench = [
        sys.executable, "-m", "services.cli.main", "bench", "serve", "--base-url", ready["http"],
        "--request-rate", str(rate), "--num-prompts", str(int(rate * seconds)),
        "--random-input-len", "256", "--random-output-len", "32", "--ignore-eos",
    ]  # fmt: skip
    print(subprocess.run(bench, capture_output=True, text=True, cwd=ROOT).stdout[-3000:])
    stop.set()
    side.join()
    time.sleep(3 * STEP_S)  # the last scrapes and rates settle
    return prometheus, start - 2 * STEP_S, time.time(), serve


def plot(prometheus: PrometheusServer, start: float, end: float) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dashboard = json.loads(DASHBOARD.read_text())
    OUT.mkdir(parents=True, exist_ok=True)
    written = []
    for title, panels in rows_of(dashboard):
        cols = 3 if len(panels) > 2 else len(panels)
        nrows = -(-len(panels) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.4 * nrows), squeeze=False)
        for ax in axes.flat[len(panels) :]:
            ax.axis("off")
        for ax, panel in zip(axes.flat, panels, strict=False):
            lines = []
            for target in panel["targets"]:
                expr = substitute(target["expr"], f"{int(4 * STEP_S)}s", TTFT_SLO, TPOT_SLO)
                for series in prometheus.query_range(expr, start, end, STEP_S):
                    points = [(float(t) - start, float(v)) for t, v in series["values"]]
                    points = [(t, v) for t, v in points if v == v]  # drop NaN (no traffic)
                    if points:
                        lines.append((legend(target["legendFormat"], series["metric"]), points))
            moving = [line for line in lines if any(v for _, v in line[1])]
            for label, points in moving or lines:  # lines that stayed 0 only when all did
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, label=label)
            ax.set_title(panel["title"], fontsize=10)
            ax.set_xlabel("seconds into the run", fontsize=8)
            ax.set_ylabel(panel["fieldConfig"]["defaults"].get("unit", ""), fontsize=8)
            ax.tick_params(labelsize=7)
            if ax.lines:
                ax.legend(fontsize=6, loc="upper left")
        fig.suptitle(f"pdserve dashboard: {title}", fontsize=12)
        fig.tight_layout()
        path = OUT / f"{slug(title)}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=90.0, help="load duration")
    parser.add_argument("--rate", type=float, default=1.5, help="requests per second")
    args = parser.parse_args()
    prometheus, start, end, serve = run(args.seconds, args.rate)
    try:
        for path in plot(prometheus, start, end):
            print(f"wrote {path.relative_to(ROOT)}")
    finally:
        serve.terminate()
        serve.wait(timeout=30)
        prometheus.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
