"""pdserve's C++ paged decode kernel on the CPU (`services/engine/kernels`)."""

from __future__ import annotations

import torch

from services.engine.attention.sdpa import TorchSDPABackend


class CPUPagedBackend(TorchSDPABackend):
    """Decode through pdserve's C++ paged-attention kernel (`services/engine/kernels`), which
    reads each request's K/V in place through its block table instead of gathering a copy per
    layer; prefill chunks go through torch SDPA as in `TorchSDPABackend`."""

    name = "cpu_paged"

    def __init__(self) -> None:
        from services.engine.kernels import load_cpu_kernels

        self.kernel = load_cpu_kernels()
        if self.kernel is None:
            raise ValueError(
                "attention_backend: 'cpu_paged' needs the C++ kernel, which could not be built here"
            )

    def _decode(self, q, k_cache, v_cache, meta, scale):
        q = q.contiguous()
        out = torch.empty_like(q)
        self.kernel.paged_decode_attention(
            out, q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale
        )
        return out
