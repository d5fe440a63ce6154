"""What two engines compare before the first transfer between them.

KV copied between caches of different shapes does not fail loudly: a bf16 cache read as fp32, or
16-token blocks read as 32-token blocks, decodes into fluent nonsense. So a destination asks its
source for its `KVPeerInfo` before the first pull and both sides refuse any difference (the
handshake of vLLM's NIXL connector and of Mooncake's transfer engine in spirit).
"""

from __future__ import annotations

import functools
import socket
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from services.engine.errors import KVHandshakeError
from services.kv_transfer.handle import KV_TENSOR_LAYOUT

if TYPE_CHECKING:
    from services.engine.kv_cache import KVCacheSpec


@dataclass(frozen=True)
class KVPeerInfo:
    """One engine's KV identity: the model whose KV it holds, and its cache layout (the one KV
    layout type, `KVCacheSpec`: num_layers, num_kv_heads, head_dim, block_size, dtype)."""

    model_id: str
    """Identity of the loaded weights (`loader.model_id`)."""
    spec: KVCacheSpec
    """Shape and dtype of the cache."""
    layout: str = KV_TENSOR_LAYOUT
    """Axis order of a transferred tensor."""

    @classmethod
    def of(cls, spec: KVCacheSpec, model_id: str) -> KVPeerInfo:
        return cls(model_id, spec)

    def fields(self) -> dict[str, object]:
        """Every compared field by name (the spec's flattened in)."""
        spec = {f.name: getattr(self.spec, f.name) for f in fields(self.spec)}
        dtype = spec.pop("dtype")  # reported right after the model: the likeliest mistake
        return {"model_id": self.model_id, "dtype": dtype, **spec, "layout": self.layout}


def mismatches(source: KVPeerInfo, destination: KVPeerInfo) -> list[str]:
    """One line per differing field, "block_size: 16 at the source (prefill), 32 at the
    destination (decode)"; empty if the two can exchange KV."""
    theirs = destination.fields()
    return [
        f"{name}: {_show(value)} at the source (prefill), "
        f"{_show(theirs[name])} at the destination (decode)"
        for name, value in source.fields().items()
        if value != theirs[name]
    ]


def _show(value: object) -> str:
    return str(value).removeprefix("torch.")  # dtypes as their names: float32, bfloat16


def check_compatible(source: KVPeerInfo, destination: KVPeerInfo, peer: str) -> None:
    """Raises KVHandshakeError naming every differing field when the two cannot exchange KV;
    `peer` names the other side in the message."""
    diff = mismatches(source, destination)
    if diff:
        raise KVHandshakeError(f"KV handshake with {peer} refused: " + "; ".join(diff))


@functools.cache
def node_id() -> str:
    """This machine's boot id (two workers with the same one share a node), else its host name."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()
