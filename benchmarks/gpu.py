"""The CUDA path's speed on one GPU, on a random-weight ~1.1B Llama (TinyLlama-1.1B's shape:
22 layers, hidden 2,048, 32 heads, 4 KV heads, bf16): what `scripts/gpu_check.sh` prints.

1. Prefill: tokens/s of one 2,048-token prompt (the step that samples its first token).
2. Decode: output tokens/s at batch 1 and 64 (CUDA graphs on), next to the HBM-bandwidth bound:
   each decode step reads every weight once plus each request's KV, so tokens/s <= batch *
   HBM bytes/s / (weight bytes + batch * context * KV bytes per token). `--hbm-tbps` is the
   device's bandwidth (H200: 4.8 TB/s).
3. KV transfer: GB/s of a block copy out of another process's cache over CUDA IPC
   (`services/kv_transfer/cuda_ipc/export.py`), next to a device copy inside one process.

    python benchmarks/gpu.py [--out benchmarks/results/gpu.json]   # ~2 min on an H200
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BLOCK_SIZE = 16


def make_model(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=4096,
        bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def timed_steps(engine, prompts, max_tokens) -> tuple[float, float, int]:
    """(seconds to every first token, seconds after that to the end, decode tokens)."""
    from services.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    start = time.perf_counter()
    first = None
    tokens = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        torch.cuda.synchronize()
        if first is None and engine.scheduler.num_waiting == 0 and outputs:
            first = time.perf_counter()
            continue
        if first is not None:
            tokens += sum(1 for o in outputs if o.new_token_ids)
    end = time.perf_counter()
    assert first is not None
    return first - start, end - first, tokens


def bench_engine(path: Path, hbm_bytes_s: float) -> dict:
    from services.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=str(path), device="cuda", attention_backend="triton",
                                 max_num_batched_tokens=4096, max_num_seqs=64))  # fmt: skip
    engine.warm_up()
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kv_per_token = engine.kv_cache.spec.bytes_per_block // BLOCK_SIZE
    prompt = list(range(10, 10 + 2048))
    timed_steps(engine, [prompt], 1)  # compile and warm every kernel first
    prefill_s, _, _ = timed_steps(engine, [[t + 1 for t in prompt]], 1)
    result = {
        "weights_GiB": weight_bytes / 2**30,
        "kv_cache_blocks": engine.kv_cache.num_blocks,
        "prefill_tokens_per_s": 2048 / prefill_s,
        "decode": [],
    }
    for batch in (1, 64):
        prompts = [[(7 * i + j) % 30000 + 2 for j in range(128)] for i in range(batch)]
        _, decode_s, tokens = timed_steps(engine, prompts, 129)
        context = 128 + 64  # mean context during the decode
        step_bytes = weight_bytes + batch * context * kv_per_token
        result["decode"].append(
            {
                "batch": batch,
                "tokens_per_s": tokens / decode_s,
                "hbm_bound_tokens_per_s": batch * hbm_bytes_s / step_bytes,
            }
        )
    return result


def _export(conn, nbytes: int) -> None:
    from services.kv_transfer.cuda_ipc.export import export_cuda_kv

    kv = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda").view(
        2, 2, nbytes // (2 * 2 * 2 * 16 * 4 * 64 * 2), 16, 4, 64
    )
    conn.send(export_cuda_kv(kv).to_json())
    conn.recv()


def bench_cuda_ipc(nbytes: int = 2 << 30, trials: int = 5) -> dict:
    from services.kv_transfer.cuda_ipc.export import CudaIpcExport, open_cuda_kv

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_export, args=(child, nbytes))
    proc.start()
    try:
        mapped = open_cuda_kv(CudaIpcExport.from_json(parent.recv()), torch.device("cuda", 0))
        num_blocks = mapped.shape[2]
        blocks = torch.randperm(num_blocks, device="cuda")[: num_blocks // 2]
        out = torch.empty(*mapped.shape[:2], len(blocks), *mapped.shape[3:],
                          dtype=mapped.dtype, device="cuda")  # fmt: skip
        moved = out.numel() * out.element_size()
        own = mapped.clone()

        def rate(source) -> float:
            torch.index_select(source, 2, blocks, out=out)
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(trials):
                start = time.perf_counter()
                torch.index_select(source, 2, blocks, out=out)
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - start)
            return moved / best / 1e9

        result = {"bytes": moved, "cuda_ipc_GB_s": rate(mapped), "same_process_GB_s": rate(own)}
        parent.send("done")
        return result
    finally:
        proc.join(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu.json"))
    parser.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth, TB/s")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pdserve-1b-") as tmp:
        started = time.perf_counter()
        path = make_model(Path(tmp))
        print(f"random-weight 1.1B Llama saved in {time.perf_counter() - started:.0f} s")
        engine = bench_engine(path, args.hbm_tbps * 1e12)
    ipc = bench_cuda_ipc()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, **engine,
              "kv_transfer": ipc}  # fmt: skip
    print(f"\n{result['device']}, torch {result['torch']}, weights {engine['weights_GiB']:.2f} GiB")
    print(f"prefill, 2,048-token prompt: {engine['prefill_tokens_per_s']:,.0f} tokens/s")
    for row in engine["decode"]:
        share = row["tokens_per_s"] / row["hbm_bound_tokens_per_s"]
        print(f"decode batch {row['batch']:>2}: {row['tokens_per_s']:,.0f} tokens/s "
              f"(HBM bound {row['hbm_bound_tokens_per_s']:,.0f}: {share:.0%})")  # fmt: skip
    print(f"KV over CUDA IPC: {ipc['cuda_ipc_GB_s']:.0f} GB/s "
          f"(in-process device copy {ipc['same_process_GB_s']:.0f} GB/s)")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
