"""Content hashes of full KV blocks, the keys of automatic prefix caching.

A block's hash chains its parent's: hash(parent block hash, model id, cache salt, the block's
token ids), so equal hashes mean equal tokens from position 0 up to the block's end, for the same
model and salt. Model id and salt enter every block as one fixed-size digest computed once per
call (`extra_key`), so a long salt costs one hash, not one per block (vLLM v1's prefix-caching
design; SGLang's radix tree reaches the same identity with a tree walk). SHA-256 over a fixed
little-endian encoding makes hashes identical across processes and hosts; Python's `hash()` is
salted per process and must never be used here.
Only full blocks are hashed: a partial block's KV is not shareable.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes
"""32-byte SHA-256 digest; `.hex()` is its text form in events, logs and (later) Redis keys."""

ROOT_HASH: BlockHash = hashlib.sha256(b"pdserve.block_hash.v1").digest()
"""The parent of every prompt's first block."""

MAX_CACHE_SALT_BYTES = 1024
"""Longest `cache_salt` accepted (UTF-8 bytes); the router and the engine refuse longer ones."""


def _field(text: str | None) -> bytes:
    """Length-prefixed UTF-8, so (model, salt) pairs can never run into each other; None and ""
    differ."""
    if text is None:
        return b"\xff\xff\xff\xff"
    data = text.encode()
    return struct.pack("<I", len(data)) + data


def max_cached_blocks(num_tokens: int, block_size: int) -> int:
    """Most leading blocks of a `num_tokens` sequence that may come from the prefix cache when
    the engine computes the rest: the last token is always computed (its logits give the next
    token), so `(num_tokens - 1) // block_size`. The scheduler and the router both apply it."""
    return (num_tokens - 1) // block_size


def extra_key(model_id: str, cache_salt: str | None = None) -> bytes:
    """The 32-byte digest of (model id, salt) that enters every block hash."""
    return hashlib.sha256(_field(model_id) + _field(cache_salt)).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes) -> BlockHash:
    """Hash of one full block whose predecessor has hash `parent` (ROOT_HASH for block 0);
    `extra` is `extra_key(model_id, cache_salt)`."""
    digest = hashlib.sha256(parent)
    digest.update(extra)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    model_id: str,
    cache_salt: str | None = None,
    known: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`: [len(token_ids) // block_size] digests.

    `known` are hashes already computed for the first blocks of the same sequence (a request
    extends its list as its output fills blocks); they are kept, not recomputed.
    """
    hashes = list(known)
    starts = range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size)
    if not starts:
        return hashes
    parent, extra = (hashes[-1] if hashes else ROOT_HASH), extra_key(model_id, cache_salt)
    for start in starts:
        parent = hash_block(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes
