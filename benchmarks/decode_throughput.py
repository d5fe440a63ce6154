"""Decode throughput of pdserve's engine against transformers `generate`, in one run.

For each dtype and batch size, the same random 128-token prompts are decoded greedily to 128 new
tokens (EOS ignored) by pdserve's engine (continuous batching over the paged KV cache; all
requests submitted at once) and by transformers `generate` on the same weights with a static
batch. Throughput is output tokens / wall time, prefill included for both. Also measured: the
single-request decode step time next to the memory-bandwidth bound (weight bytes / copy
bandwidth), and every pdserve output judged against transformers' by the equivalence rule.

    python benchmarks/decode_throughput.py                       # the full table (~25 min)
    python benchmarks/decode_throughput.py --batch-sizes 1,32 --dtypes bfloat16

Prints a table and writes JSON (default benchmarks/results/decode_throughput.json).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path

import torch
from equivalence import judge
from report import write_result
from transformers import AutoModelForCausalLM

from services.engine import Engine, EngineConfig, SamplingParams
from services.engine.loader import resolve_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch-sizes", default="1,4,16,32,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--threads", type=int, default=2, help="torch intra-op threads for both sides"
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs per point; the fastest counts, for both sides"
    )
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "decode_throughput.json")
    )
    return parser.parse_args()


def copy_bandwidth(num_bytes: int = 256 << 20) -> float:
    """Bytes moved per second (read + written) by a large tensor copy, best of 5."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best


def run_pdserve(
    engine: Engine, prompts: list[list[int]], max_tokens: int
) -> tuple[float, list[list[int]], list[float]]:
    """(wall seconds, outputs, per-step seconds after the first) for all prompts at once."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    outputs: dict[str, list[int]] = {}
    step_times = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.output_token_ids
        step_times.append(time.perf_counter() - step_start)
    wall = time.perf_counter() - start
    return wall, [outputs[i] for i in ids], step_times[1:]


@torch.inference_mode()
def run_transformers(
    model, prompts: list[list[int]], max_tokens: int
) -> tuple[float, list[list[int]]]:
    input_ids = torch.tensor(prompts)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    wall = time.perf_counter() - start
    return wall, out[:, input_ids.shape[1] :].tolist()


def bench_dtype(args, path: str, dtype: str, batch_sizes: list[int]) -> list[dict]:
    engine = Engine(EngineConfig(model=path, dtype=dtype, max_num_seqs=max(batch_sizes), seed=0))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    vocab = hf.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    warm = [torch.randint(100, vocab, (args.prompt_len,), generator=generator).tolist()]
    run_pdserve(engine, warm, 4)
    run_transformers(hf, warm, 4)
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())  # tied weights once
    rows = []
    for batch in batch_sizes:
        prompts = [
            torch.randint(100, vocab, (args.prompt_len,), generator=generator).tolist()
            for _ in range(batch)
        ]
        ours, theirs = [], []
        for _ in range(args.repeats):
            ours.append(run_pdserve(engine, prompts, args.max_tokens))
            theirs.append(run_transformers(hf, prompts, args.max_tokens))
        pd_wall, pd_out, steps = min(ours, key=lambda r: r[0])
        hf_wall, hf_out = min(theirs, key=lambda r: r[0])
        verdicts = [
            judge(engine, hf, dtype, p, a, b)
            for p, a, b in zip(prompts, pd_out, hf_out, strict=True)
        ]
        num_tokens = batch * args.max_tokens
        row = {
            "dtype": dtype,
            "batch": batch,
            "pdserve_tokens_per_s": num_tokens / pd_wall,
            "transformers_tokens_per_s": num_tokens / hf_wall,
            "ratio": hf_wall / pd_wall,
            "pdserve_step_ms_median": 1000 * statistics.median(steps),
            "weight_bytes": weight_bytes,
            "identical_outputs": sum(v.equal for v in verdicts),
            "equivalent_outputs": sum(v.allowed for v in verdicts),
            "divergences": [v.detail for v in verdicts if not v.equal],
        }
        rows.append(row)
        print(
            f"  {dtype:9s} batch {batch:3d}: pdserve {row['pdserve_tokens_per_s']:7.1f} tok/s, "
            f"transformers {row['transformers_tokens_per_s']:7.1f} tok/s, x{row['ratio']:.2f}, "
            f"equivalent {row['equivalent_outputs']}/{batch}",
            flush=True,
        )
    return rows


def print_table(rows: list[dict], bandwidth: float) -> None:
    print(
        f"\n{'dtype':9s} {'batch':>5s} {'pdserve tok/s':>14s} {'HF tok/s':>9s} {'ratio':>6s} "
        f"{'step ms':>8s} {'equivalent':>10s}"
    )
    for r in rows:
        print(
            f"{r['dtype']:9s} {r['batch']:5d} {r['pdserve_tokens_per_s']:14.1f} "
            f"{r['transformers_tokens_per_s']:9.1f} {r['ratio']:5.2f}x "
            f"{r['pdserve_step_ms_median']:8.1f} {r['equivalent_outputs']:>5d}/{r['batch']}"
        )
    for r in rows:
        if r["batch"] == 1:
            bound = 1000 * r["weight_bytes"] / bandwidth
            print(
                f"single request, {r['dtype']}: step {r['pdserve_step_ms_median']:.1f} ms; "
                f"memory-bandwidth bound {bound:.1f} ms ({r['weight_bytes'] / 1e6:.0f} MB of "
                f"weights at {bandwidth / 1e9:.1f} GB/s copy)"
            )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    bandwidth = copy_bandwidth()
    rows = []
    for dtype in args.dtypes.split(","):
        rows += bench_dtype(args, path, dtype, batch_sizes)
    print_table(rows, bandwidth)
    single = {r["dtype"]: r for r in rows if r["batch"] == 1}
    summary = {}
    if "bfloat16" in single and "float32" in single:
        summary["bf16_single_vs_transformers_fp32"] = (
            single["bfloat16"]["pdserve_tokens_per_s"]
            / single["float32"]["transformers_tokens_per_s"]
        )
        print(
            "one bfloat16 request vs transformers float32: "
            f"x{summary['bf16_single_vs_transformers_fp32']:.2f}"
        )
    write_result(
        "decode_throughput.py",
        args,
        args.threads,
        {"copy_bandwidth_bytes_per_s": bandwidth, "rows": rows, "summary": summary},
    )


if __name__ == "__main__":
    main()
