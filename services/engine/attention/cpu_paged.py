"""pdserve's C++ paged decode kernel on the CPU (`services/engine/kernels`), and blocked
bfloat16 prefill attention where torch's flash kernel would run it through float32 BLAS."""

from __future__ import annotations

import torch

from services.cpu import has_amx
from services.engine.attention.blocked_prefill import causal_attention
from services.engine.attention.sdpa import TorchSDPABackend, gather


class CPUPagedBackend(TorchSDPABackend):
    """Decode through pdserve's C++ paged-attention kernel (`services/engine/kernels`), which
    reads each request's K/V in place through its block table instead of gathering a copy per
    layer. Prefill chunks go through torch SDPA as in `TorchSDPABackend`, except bfloat16 ones
    on a CPU without AMX, which `blocked_prefill.causal_attention` computes (2.4x faster at
    2,048 tokens on an AVX-512 BF16 EPYC, where torch's flash kernel runs MKL's generic float32
    GEMM; docs/benchmarks.md, "A ninth sitting"); `blocked`: whether it does. With AMX torch's
    kernel multiplies bfloat16 tiles and is the faster one (8.6 against 18.0 ms a layer at 2,048
    tokens on an AMX Xeon; "A tenth sitting")."""

    name = "cpu_paged"

    def __init__(self) -> None:
        from services.engine.kernels import load_cpu_kernels

        self.kernel = load_cpu_kernels()
        if self.kernel is None:
            raise ValueError(
                "attention_backend: 'cpu_paged' needs the C++ kernel, which could not be built here"
            )
        self.blocked = not has_amx()

    def _fresh_prefill(self, q, k, v, num_seqs, scale):
        if not self._blocks(q):
            return super()._fresh_prefill(q, k, v, num_seqs, scale)
        length = q.shape[0] // num_seqs
        return torch.cat(
            [
                causal_attention(*(t[i * length : (i + 1) * length] for t in (q, k, v)), scale)
                for i in range(num_seqs)
            ]
        )

    def _cached_prefill(self, q, k_cache, v_cache, seq, scale):
        if not self._blocks(q):
            return super()._cached_prefill(q, k_cache, v_cache, seq, scale)
        k, v = (gather(cache, seq.block_table, seq.context_len) for cache in (k_cache, v_cache))
        return causal_attention(q, k, v, scale)

    def _blocks(self, q: torch.Tensor) -> bool:
        return self.blocked and q.dtype == torch.bfloat16

    def _decode(self, q, k_cache, v_cache, meta, scale):
        q = q.contiguous()
        out = torch.empty_like(q)
        self.kernel.paged_decode_attention(
            out, q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale
        )
        return out
