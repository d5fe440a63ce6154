"""Prefill attention per layer: torch SDPA against the blocked form (`blocked_prefill.py`), with
and without its C++ causal softmax, on the default model's heads.

    python benchmarks/prefill_attention.py [--threads 2] [--dtype bfloat16]

Shapes: fresh prompts (queries == keys, SDPA's causal kernel) and chunks after a cached prefix
(SDPA with an explicit mask, as `TorchSDPABackend` runs them). Medians of `--repeats` calls after
two warm-ups, milliseconds; the max |error| of each against float32 SDPA. Figures:
docs/benchmarks.md, "A ninth sitting".
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = ((2048, 2048), (256, 256), (512, 1536), (256, 2048))  # (queries, keys)


def main() -> int:
    import torch
    import torch.nn.functional as F

    from services.engine.attention import blocked_prefill

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head_dim")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    num_heads, num_kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    scale = head_dim**-0.5
    kernels = blocked_prefill.load_cpu_kernels

    def median_ms(fn) -> float:
        fn(), fn()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    print(f"{args.dtype}, {args.threads} threads, heads {args.heads}: ms a layer (max |error|)")
    for queries, keys in SHAPES:
        gen = torch.Generator().manual_seed(queries + keys)
        q = torch.randn(queries, num_heads, head_dim, generator=gen).to(dtype)
        k, v = (torch.randn(keys, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in "kv")
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        positions = torch.arange(keys - queries, keys)
        mask = torch.arange(keys)[None, :] <= positions[:, None]
        causal = {"is_causal": True} if queries == keys else {"attn_mask": mask}
        ref = F.scaled_dot_product_attention(
            qs.float(), ks.float(), vs.float(), attn_mask=mask, scale=scale, enable_gqa=True
        )[0].transpose(0, 1)

        def sdpa(qs=qs, ks=ks, vs=vs, causal=causal):
            out = F.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=True, **causal)
            return out[0].transpose(0, 1)

        def blocked(q=q, k=k, v=v):
            return blocked_prefill.causal_attention(q, k, v, scale)

        cells = []
        for name, fn, fused in (("sdpa", sdpa, True), ("blocked, torch ops", blocked, False),
                                ("blocked, C++ softmax", blocked, True)):  # fmt: skip
            blocked_prefill.load_cpu_kernels = kernels if fused else (lambda: None)
            if fused and name != "sdpa" and kernels() is None:
                continue
            error = (fn().float() - ref).abs().max().item()
            cells.append(f"{name} {median_ms(fn):.2f} ({error:.4f})")
        blocked_prefill.load_cpu_kernels = kernels
        print(f"  {queries} queries over {keys} keys: " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
