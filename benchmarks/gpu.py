"""The CUDA path's speed on one GPU, each figure a ratio to a bound measured in the same run.

Phases (`--phase`, each one its own process under `scripts/gpu_check.sh`; every phase adds its
figures to the JSON file `--out` as soon as it has them, so a timeout keeps what came before):

- `bounds`: the device's own ceilings. HBM bandwidth from a 4 GiB device-to-device copy,
  counting bytes read + written (2 x 4 GiB per copy); the bf16 matmul peak from 8192^3 GEMMs on
  random data (3 warm-ups, mean of 10). CUDA events time both.
- `llama-1b`, `llama-8b`: an engine (Triton attention, bf16) around a Llama with random weights
  made on the GPU from its config alone (vLLM's `--load-format dummy`: the loader's
  `from_pretrained` is swapped for `from_config`, no checkpoint is written or read). Shapes:
  TinyLlama-1.1B (22 layers, hidden 2,048, 32 heads, 4 KV heads) and Llama-3-8B (32 layers,
  hidden 4,096, 32 heads, 8 KV heads, intermediate 14,336, vocab 128,256).
  Prefill: tokens/s of one 2,048-token prompt (the step that samples its first token, mean of
  3 after a warm-up); its FLOP/s = 2 x matmul params x tokens (the lm_head once: only the last
  row's logits are computed), plus causal attention 2 x layers x tokens^2 x hidden, as a ratio
  to the measured bf16 peak. Decode: output tokens/s of the steps where all `batch` requests
  decode (batch 1 and 64, 256-token prompts, 128 new tokens), CUDA graphs on, then off (the
  same engine with its runner's graphs removed: what --enforce-eager does); the HBM bound of
  each step reads every weight but the embedding table (the lm_head included) plus each
  request's K and V up to its context, at the measured copy bandwidth.
- `ipc`: GB/s of a block gather (half of a 2 GiB cache's blocks, bytes copied counted once) out
  of another process's cache over CUDA IPC (`services/kv_transfer/cuda_ipc/export.py`), and the
  same gather out of a cache in this process.
- `report`: the ratios, from the JSON alone (no GPU needed).

    python benchmarks/gpu.py --phase all --out /tmp/gpu.json   # ~2 min on an H200
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402 - after the path, as the benchmarks' other scripts

PHASES = ("bounds", "llama-1b", "llama-8b", "ipc", "report")
SHAPES = {
    "llama-1b": dict(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4,
    ),
    "llama-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
    ),
}  # fmt: skip
DEVICE, ATTENTION = "cuda", "triton"  # a CPU dry run of the phases' logic swaps these
PREFILL_TOKENS = 2048
DECODE_PROMPT, DECODE_TOKENS, BATCHES = 256, 128, (1, 64)


# -- the JSON, written as it goes ------------------------------------------------------------


def update(out: Path, key: str, value: Any) -> None:
    """Set `key` in the JSON file `out` (atomically: a kill leaves the previous file whole)."""
    data = json.loads(out.read_text()) if out.is_file() else {}
    data[key] = value
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, out)


def cuda_mean_s(fn: Callable[[], object], warmup: int, trials: int) -> float:
    """Mean seconds of `fn` by CUDA events, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(trials):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / trials


# -- bounds ----------------------------------------------------------------------------------


def bounds(out: Path) -> None:
    import transformers
    import triton

    update(out, "env", {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "transformers": transformers.__version__,
        "triton": triton.__version__,
    })  # fmt: skip
    nbytes = 4 << 30
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    copy_s = cuda_mean_s(functools.partial(dst.copy_, src), warmup=3, trials=10)
    hbm = {
        "copy_bytes": nbytes,
        "copy_s": copy_s,
        "read_plus_write_GB_s": 2 * nbytes / copy_s / 1e9,
    }
    update(out, "hbm", hbm)
    del src, dst
    n = 8192
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    gemm_s = cuda_mean_s(lambda: a @ b, warmup=3, trials=10)
    update(out, "bf16_gemm", {"n": n, "mean_s": gemm_s, "TFLOP_s": 2 * n**3 / gemm_s / 1e12})
    print(f"HBM copy {hbm['read_plus_write_GB_s']:,.0f} GB/s (read+write); "
          f"bf16 GEMM {2 * n**3 / gemm_s / 1e12:,.0f} TFLOP/s")  # fmt: skip


# -- an engine around a random-weight model --------------------------------------------------


@contextlib.contextmanager
def dummy_weights() -> Iterator[None]:
    """While open, the engine's loader builds the model from the folder's config.json with
    random weights, directly on the GPU (`from_config` under a CUDA device), reading no
    weights."""
    from unittest import mock

    from transformers import AutoConfig, AutoModelForCausalLM

    def build(path: str, dtype: torch.dtype | None = None, **_: Any) -> Any:
        with torch.device(DEVICE):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)

    with mock.patch.object(AutoModelForCausalLM, "from_pretrained", build):
        yield


def make_engine(shape: str, folder: Path) -> Any:
    from transformers import LlamaConfig

    from services.engine import Engine, EngineConfig

    LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
                tie_word_embeddings=False).save_pretrained(folder)  # fmt: skip
    config = EngineConfig(
        model=str(folder), device=DEVICE, dtype="bfloat16", attention_backend=ATTENTION,
        num_blocks=max(BATCHES) * (DECODE_PROMPT + DECODE_TOKENS) // 16 + 512,
        max_model_len=4096, max_num_seqs=max(BATCHES), max_num_batched_tokens=8192,
        max_cuda_graph_batch_size=max(BATCHES), enable_prefix_caching=False, seed=0,
    )  # fmt: skip
    with dummy_weights():
        return Engine(config)


def prefill_s(engine: Any, first_token: int) -> float:
    from services.engine import SamplingParams

    prompt = [(first_token + i) % 30000 + 2 for i in range(PREFILL_TOKENS)]
    engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def decode(engine: Any, batch: int, weight_bytes: int, hbm_bytes_s: float | None) -> dict:
    """Tokens/s over the steps where all `batch` requests decode, and the HBM bound of those
    same steps (weights + every request's KV up to its context, per step)."""
    from services.engine import SamplingParams

    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(97 * i + j) % 30000 + 2 for j in range(DECODE_PROMPT)], params)
    kv_per_token = engine.kv_cache.spec.bytes_per_block // engine.kv_cache.spec.block_size
    started: set[str] = set()
    seconds, tokens, steps, bound_bytes = 0.0, 0, 0, 0
    while engine.has_unfinished_requests():
        begin = time.perf_counter()
        outputs = engine.step()
        took = time.perf_counter() - begin  # step() returns after its tokens reach the host
        full = len(started) == batch and len(outputs) == batch
        full = full and all(len(o.new_token_ids) == 1 for o in outputs)
        if full:
            seconds, tokens, steps = seconds + took, tokens + batch, steps + 1
            # the step read each request's KV up to its context (prompt + earlier outputs)
            context = sum(DECODE_PROMPT + len(o.output_token_ids) - 1 for o in outputs)
            bound_bytes += weight_bytes + context * kv_per_token
        started.update(o.request_id for o in outputs if o.output_token_ids)
    row: dict[str, Any] = {
        "batch": batch,
        "steps": steps,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "ms_per_step": 1e3 * seconds / steps,
        "bytes_read": bound_bytes,  # weights but the embedding table, + KV, over the steps
    }
    if hbm_bytes_s:
        with_bound(row, hbm_bytes_s)
    return row


def with_bound(row: dict[str, Any], hbm_bytes_s: float) -> dict[str, Any]:
    """`row` with its HBM bound: its tokens in the time its bytes take at `hbm_bytes_s`."""
    row["hbm_bound_tokens_per_s"] = row["tokens"] / (row["bytes_read"] / hbm_bytes_s)
    row["ratio_to_bound"] = row["tokens_per_s"] / row["hbm_bound_tokens_per_s"]
    return row


def model_phase(shape: str, out: Path) -> None:
    data = json.loads(out.read_text()) if out.is_file() else {}
    hbm = data.get("hbm", {}).get("read_plus_write_GB_s")
    with tempfile.TemporaryDirectory(prefix=f"pdserve-{shape}-") as tmp:
        started = time.perf_counter()
        engine = make_engine(shape, Path(tmp))
    load_s = time.perf_counter() - started
    params = dict(engine.model.named_parameters())
    embed = sum(p.nbytes for name, p in params.items() if name.startswith("embed_tokens"))
    weight_bytes = sum(p.nbytes for p in params.values()) - embed  # read per decode step
    config = engine.model.config
    lm_head = config.vocab_size * config.hidden_size
    embed_params = sum(p.numel() for n, p in params.items() if n.startswith("embed_tokens"))
    layer_params = sum(p.numel() for p in params.values()) - lm_head - embed_params
    flops = (2 * layer_params * PREFILL_TOKENS + 2 * lm_head
             + 2 * config.num_hidden_layers * PREFILL_TOKENS**2 * config.hidden_size)  # fmt: skip
    result: dict[str, Any] = {
        "engine_start_s": load_s, "weights_GiB": (weight_bytes + embed) / 2**30,
        "weights_read_per_step_GiB": weight_bytes / 2**30, "kv_blocks": engine.kv_cache.num_blocks,
        "graph_sizes": list(engine.runner.graphs.sizes) if engine.runner.graphs else None,
    }  # fmt: skip
    update(out, shape, result)
    engine.warm_up()
    prefill_s(engine, 0)  # compiles and settles every prefill kernel
    seconds = sum(prefill_s(engine, 1000 * (k + 1)) for k in range(3)) / 3
    result["prefill"] = {
        "tokens": PREFILL_TOKENS,
        "seconds": seconds,
        "tokens_per_s": PREFILL_TOKENS / seconds,
        "TFLOP_s": flops / seconds / 1e12,
        "flops_counted": "2*matmul params*tokens + 2*layers*tokens^2*hidden",
    }
    update(out, shape, result)
    print(f"{shape}: start {load_s:.1f} s, prefill {PREFILL_TOKENS / seconds:,.0f} tokens/s "
          f"({flops / seconds / 1e12:,.0f} TFLOP/s)")  # fmt: skip
    graphs = engine.runner.graphs
    hbm_bytes_s = hbm * 1e9 if hbm else None
    for label, runner_graphs in (("graphs", graphs), ("eager", None)):
        engine.runner.graphs = runner_graphs
        rows = result.setdefault(f"decode_{label}", [])
        for batch in BATCHES:
            rows.append(decode(engine, batch, weight_bytes, hbm_bytes_s))
            update(out, shape, result)
            print(f"{shape}: decode {label} batch {batch}: {rows[-1]['tokens_per_s']:,.0f} "
                  f"tokens/s ({rows[-1]['ms_per_step']:.2f} ms/step)")  # fmt: skip
    engine.runner.graphs = graphs


# -- CUDA IPC --------------------------------------------------------------------------------


def _export(conn: Any, nbytes: int) -> None:
    from services.kv_transfer.cuda_ipc.export import export_cuda_kv

    blocks = nbytes // (2 * 2 * 16 * 8 * 128 * 2)  # [layers 2, K/V, blocks, 16, 8 heads, 128]
    kv = torch.ones(2, 2, blocks, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    conn.send(export_cuda_kv(kv).to_json())
    conn.recv()


def ipc(out: Path, nbytes: int = 2 << 30) -> None:
    from services.kv_transfer.cuda_ipc.export import CudaIpcExport, open_cuda_kv

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_export, args=(child, nbytes), daemon=True)
    proc.start()
    try:
        mapped = open_cuda_kv(CudaIpcExport.from_json(parent.recv()), torch.device("cuda", 0))
        gen = torch.Generator(device="cuda").manual_seed(0)
        num_blocks = mapped.shape[2]
        blocks = torch.randperm(num_blocks, device="cuda", generator=gen)[: num_blocks // 2]
        local = torch.empty(*mapped.shape[:2], len(blocks), *mapped.shape[3:],
                            dtype=mapped.dtype, device="cuda")  # fmt: skip
        moved = local.nbytes
        own = mapped.clone()

        def rate(source: torch.Tensor) -> float:
            s = cuda_mean_s(lambda: torch.index_select(source, 2, blocks, out=local), 2, 10)
            return moved / s / 1e9

        result = {"bytes_copied": moved, "cuda_ipc_GB_s": rate(mapped),
                  "same_process_GB_s": rate(own), "counted": "bytes copied, once"}  # fmt: skip
        result["ratio"] = result["cuda_ipc_GB_s"] / result["same_process_GB_s"]
        update(out, "cuda_ipc", result)
        print(f"CUDA IPC {result['cuda_ipc_GB_s']:,.0f} GB/s, in-process "
              f"{result['same_process_GB_s']:,.0f} GB/s")  # fmt: skip
        parent.send("done")
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


# -- report ----------------------------------------------------------------------------------


def report(out: Path) -> list[str]:
    """The summary lines (and `summary` in the JSON): each figure with its measured bound."""
    data = json.loads(out.read_text()) if out.is_file() else {}
    lines = [f"{k}: {v}" for k, v in data.get("env", {}).items()]
    hbm = data.get("hbm", {}).get("read_plus_write_GB_s")
    peak = data.get("bf16_gemm", {}).get("TFLOP_s")
    lines.append(f"bounds: HBM copy {hbm or 0:,.0f} GB/s (read+write), bf16 GEMM {peak or 0:,.0f} "
                 "TFLOP/s")  # fmt: skip
    for shape in ("llama-1b", "llama-8b"):
        model = data.get(shape)
        if not model:
            lines.append(f"{shape}: no figures (phase failed or timed out)")
            continue
        pre = model.get("prefill")
        if pre:
            share = f"{pre['TFLOP_s'] / peak:.0%} of the bf16 peak" if peak else "no peak"
            lines.append(f"{shape} prefill {pre['tokens']}: {pre['tokens_per_s']:,.0f} tokens/s, "
                         f"{pre['TFLOP_s']:,.0f} TFLOP/s = {share}")  # fmt: skip
        eager = {r["batch"]: r for r in model.get("decode_eager", [])}
        for row in eager.values():
            if hbm:
                with_bound(row, hbm * 1e9)
        for row in model.get("decode_graphs", []):
            if hbm:  # the bound of this run, also when the phase ran before the bounds
                with_bound(row, hbm * 1e9)
            text = f"{shape} decode batch {row['batch']}: {row['tokens_per_s']:,.0f} tokens/s"
            if "ratio_to_bound" in row:
                text += (f", HBM bound {row['hbm_bound_tokens_per_s']:,.0f} (bound/achieved "
                         f"{1 / row['ratio_to_bound']:.2f}x)")  # fmt: skip
            if shape == "llama-8b" and row["batch"] == 1 and "ratio_to_bound" in row:
                met = 1 / row["ratio_to_bound"] <= 1.5
                text += f" [target <= 1.5x: {'met' if met else 'MISSED'}]"
            if row["batch"] in eager:
                speedup = row["tokens_per_s"] / eager[row["batch"]]["tokens_per_s"]
                text += f"; graphs' speed-up over eager {speedup:.2f}x"
            lines.append(text)
    cuda_ipc = data.get("cuda_ipc")
    if cuda_ipc:
        ipc_rate, own_rate = cuda_ipc["cuda_ipc_GB_s"], cuda_ipc["same_process_GB_s"]
        lines.append(
            f"CUDA IPC {ipc_rate:,.0f} GB/s = {cuda_ipc['ratio']:.0%} of an in-process gather "
            f"({own_rate:,.0f} GB/s)"
        )
    if data:
        update(out, "summary", lines)
        for shape in ("llama-1b", "llama-8b"):
            if shape in data:
                update(out, shape, data[shape])  # with the bounds report computed
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu.json"))
    parser.add_argument("--phase", choices=(*PHASES, "all"), default="all")
    args = parser.parse_args()
    out = Path(args.out)
    phases = PHASES if args.phase == "all" else (args.phase,)
    if set(phases) - {"report"} and not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py: needs CUDA (only --phase report runs without it)")
    for phase in phases:
        if phase == "bounds":
            bounds(out)
        elif phase == "ipc":
            ipc(out)
        elif phase == "report":
            print("\n".join(report(out)))
        else:
            model_phase(phase, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
