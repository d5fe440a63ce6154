"""Start-up self-test: the chosen attention backend against torch SDPA on a small paged step.

A kernel built for another GPU or torch can run and return zeros or garbage without raising
(a known failure of prebuilt flash-attn wheels), so an engine checks its backend before it
serves and refuses to start on a mismatch. The step mixes what serving meets: a fresh prompt,
a chunk after a cached prefix, and decodes whose blocks are scattered through the cache, with
a large value (`FOREIGN`) in every slot no request owns, so a read outside a block table shows
up at once. (Not NaN: FlexAttention and the padded decode paths multiply masked slots by an
exact zero, which a cache of finite values, as a served one always is, passes and NaN fails.)
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass
from importlib import metadata

import torch

from services.engine.attention.base import AttentionBackend
from services.engine.attention.metadata import AttentionMetadata, PrefillSeq

logger = logging.getLogger(__name__)

FOREIGN = 1e4  # what a slot no request owns holds in the self-test
# Max |backend - SDPA| allowed on the self-test's unit-variance inputs, by dtype: about four
# units in the last place of outputs below 4 (a wrong kernel is off by the outputs' own size).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 6.25e-2, torch.float16: 8e-3}


class AttentionSelfTestError(RuntimeError):
    """The chosen attention backend disagrees with torch SDPA: the engine must not serve."""


@dataclass(frozen=True)
class PagedStep:
    """One random step over a paged cache: inputs for `AttentionBackend.forward`."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    meta: AttentionMetadata

    def clone_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache.clone(), self.v_cache.clone()


def random_step(
    requests: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> PagedStep:
    """A step whose requests are (cached tokens, new tokens) pairs; a request with 1 new token
    is a decode (as the model runner batches it), the others prefill (fresh or a chunk).
    Blocks are handed out in random order; cached positions hold random K/V, the rest of a
    request's blocks zeros, every block no request owns FOREIGN."""
    gen = torch.Generator().manual_seed(seed)
    needs = [-(-(cached + new) // block_size) for cached, new in requests]
    num_blocks = sum(needs) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, FOREIGN, dtype=dtype)
    v_cache = torch.full(shape, FOREIGN, dtype=dtype)
    tables = [[order.pop() for _ in range(n)] for n in needs]
    for (cached, new), table in zip(requests, tables, strict=True):
        k_cache[table] = 0  # owned blocks start zeroed, as `KVCache.allocate_slots` leaves them
        v_cache[table] = 0
        for pos in range(cached + new):  # cached: random; new: finite until the write
            block, offset = table[pos // block_size], pos % block_size
            k_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
            v_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
    # Prefills first, then decodes: the token order the model runner builds.
    order_idx = sorted(range(len(requests)), key=lambda i: requests[i][1] == 1)
    prefills, slots, decode_tables, decode_lens, start = [], [], [], [], 0
    for i in order_idx:
        cached, new = requests[i]
        table = tables[i]
        positions = torch.arange(cached, cached + new)
        slots.append(
            torch.tensor(table)[positions // block_size] * block_size + positions % block_size
        )
        if new == 1:
            decode_tables.append(table)
            decode_lens.append(cached + 1)
        else:
            prefills.append(
                PrefillSeq(start, new, cached + new, torch.tensor(table, device=device))
            )
        start += new
    width = max((len(t) for t in decode_tables), default=0)
    padded = [t + [t[0]] * (width - len(t)) for t in decode_tables]
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        prefills=tuple(prefills),
        num_prefill_tokens=sum(p.query_len for p in prefills),
        decode_block_tables=torch.tensor(padded, dtype=torch.long)
        .reshape(len(padded), width)
        .to(device),
        decode_context_lens=torch.tensor(decode_lens, dtype=torch.long, device=device),
        block_size=block_size,
    )
    num_tokens = start
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    return PagedStep(
        q.to(device), k.to(device), v.to(device), k_cache.to(device), v_cache.to(device), meta
    )


def versions() -> dict[str, str]:
    """What the backend's numbers depend on: torch, its CUDA, triton, flash-attn, the device."""
    found = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    for package in ("triton", "flash-attn"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "absent"
    found["device"] = (
        torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
    )
    return found


def self_test(
    backend: AttentionBackend,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
) -> float:
    """Run `backend` and torch SDPA on one mixed step; returns the max abs difference.

    Raises AttentionSelfTestError (naming the backend and the versions) when it exceeds
    `TOLERANCE[dtype]`, when the backend's output is not finite, or when it wrote the cache
    differently.
    """
    from services.engine.attention.sdpa import TorchSDPABackend

    requests = [(0, 5), (block_size + 2, 3), (2 * block_size + 1, 1), (6, 1)]
    step = random_step(
        requests,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
    )
    scale = head_dim**-0.5
    outputs, caches = [], []
    for candidate in (TorchSDPABackend(), backend):
        k_cache, v_cache = step.clone_caches()
        outputs.append(
            candidate.forward(step.query, step.key, step.value, k_cache, v_cache, step.meta, scale)
        )
        caches.append((k_cache, v_cache))
    want, got = outputs
    error = (
        float((got.float() - want.float()).abs().max()) if got.isfinite().all() else float("inf")
    )
    found = versions()
    (k_want, v_want), (k_got, v_got) = caches
    same_write = torch.equal(k_want, k_got) and torch.equal(v_want, v_got)
    if not error <= TOLERANCE[dtype] or not same_write:
        raise AttentionSelfTestError(
            f"attention_backend: {backend.name!r} disagrees with torch SDPA on the start-up "
            f"self-test (max |diff| {error:.3g} > {TOLERANCE[dtype]:g} in {dtype}, or a "
            f"different cache write); refusing to serve. Versions: {found}"
        )
    logger.info(
        "attention backend %s passed its self-test (max |diff| %.2g); %s",
        backend.name,
        error,
        found,
    )
    return error
