"""Every CUDA attention backend agrees with torch SDPA in bf16: the start-up self-test's mixed
step, and a step of long contexts (past many of Triton's key tiles and blocks), for block sizes
16 and 256 and two head shapes (the small test Llama's and Llama-3-8B's). flash-attn's cases
skip, by name, where it is not installed (the lent H200 has none)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.models import DEVICE, DTYPE, GPU

pytestmark = GPU

SHAPES = {"h8-kv2-d64": (8, 2, 64), "h32-kv8-d128": (32, 8, 128)}
# (cached tokens, new tokens): prompts, a chunk after a long prefix, decodes of long contexts
LONG_STEP = [(0, 300), (700, 129), (1000, 1), (37, 1), (513, 1), (2047, 1)]


def _backend(name: str, block_size: int):
    from services.engine.attention import get_attention_backend

    if name == "flash_attn":
        from services.engine.attention.flash import flash_attn_version

        if flash_attn_version() is None:
            pytest.skip("flash-attn is not installed (named skip: absent on the lent H200)")
    return get_attention_backend(name, DEVICE, block_size)


CASES = [
    (name, block_size, shape)
    for name in ("triton", "flex", "flash_attn")
    for block_size in (16, 256)
    for shape in SHAPES
    if not (name == "flash_attn" and block_size % 256)  # flash-attn pages: multiples of 256
]


@pytest.mark.parametrize(("name", "block_size", "shape"), CASES)
def test_backend_agrees_with_sdpa_in_bf16(name: str, block_size: int, shape: str) -> None:
    from services.engine.attention.sdpa import TorchSDPABackend
    from services.engine.attention.self_test import TOLERANCE, random_step, self_test

    backend = _backend(name, block_size)
    heads, kv_heads, head_dim = SHAPES[shape]
    dims = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size)
    error = self_test(backend, **dims, dtype=DTYPE, device=DEVICE)  # raises on a mismatch
    step = random_step(LONG_STEP, **dims, dtype=DTYPE, device=DEVICE, seed=3)
    outputs, caches = [], []
    for candidate in (TorchSDPABackend(), backend):
        k_cache, v_cache = step.clone_caches()
        q, k, v, scale = step.query, step.key, step.value, head_dim**-0.5
        out = candidate.forward(q, k, v, k_cache, v_cache, step.meta, scale)
        outputs.append(out.float())
        caches.append((k_cache, v_cache))
    long_error = float((outputs[1] - outputs[0]).abs().max())
    print(f"  {name} block {block_size} {shape}: self-test {error:.3g}, long step {long_error:.3g}")
    assert torch.isfinite(outputs[1]).all()
    assert long_error <= TOLERANCE[DTYPE], f"{name}: max |diff| vs SDPA {long_error:.3g}"
    assert all(torch.equal(a, b) for a, b in zip(caches[0], caches[1], strict=True))
