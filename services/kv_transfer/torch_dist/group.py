"""One torch.distributed process group per prefill/decode pair (rank 0 the source, rank 1 the
destination), built straight from a TCPStore the source serves, without the global default
group (`init_process_group`), so a worker holds any number of pairs and a peer that restarts or
joins later gets a new group instead of hanging an old one. NCCL between GPUs, gloo between CPU
processes; every operation is bounded by the group's timeout.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

PG_BACKEND = {"cpu": "gloo", "cuda": "nccl"}
"""The process-group backend for a KV cache on each device type."""


def serve_store(host: str, timeout_s: float) -> dist.TCPStore:
    """The source's store for one pair, on a free port of `host` (`store.port`)."""
    return dist.TCPStore(host, 0, 2, True, timedelta(seconds=timeout_s), wait_for_workers=False)


def join_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The destination's client of the source's store. Raises RuntimeError/DistStoreError."""
    return dist.TCPStore(host, port, 2, False, timedelta(seconds=timeout_s))


def group_name() -> str:
    return f"pdserve-kv-{uuid.uuid4().hex[:12]}"


class PairGroup:
    """A two-rank process group over `store`: `send` (rank 0) and `recv` (rank 1) of one
    contiguous tensor, each bounded by `timeout_s`. Both ranks must construct theirs at the
    same time (the constructor rendezvous through the store). Raises RuntimeError (the peer
    did not join in time, or died) from the constructor, `send` and `recv`; after one, the
    group is unusable: close it and build a new one."""

    def __init__(
        self,
        store: dist.Store,
        name: str,
        rank: int,
        device_type: str,
        timeout_s: float,
        host: str = "127.0.0.1",
    ) -> None:
        self.name, self.rank, self.backend = name, rank, PG_BACKEND[device_type]
        self.timeout = timedelta(seconds=timeout_s)
        prefix = dist.PrefixStore(name, store)
        if self.backend == "gloo":
            gloo: Any = dist.ProcessGroupGloo  # its _Options are not in the stubs
            options = gloo._Options()
            options._timeout = self.timeout
            options._devices = [gloo.create_device(hostname=host)]
            self.pg: Any = gloo(prefix, rank, 2, options)
        else:  # CUDA builds only
            nccl: Any = getattr(dist, "ProcessGroupNCCL")  # noqa: B009 - absent on CPU builds
            options = nccl.Options()
            options._timeout = self.timeout
            self.pg = nccl(prefix, rank, 2, options)
        self.store = store  # the group uses it for its lifetime

    def send(self, tensor: torch.Tensor, tag: int) -> None:
        self.pg.send([tensor], 1 - self.rank, tag).wait(self.timeout)

    def recv(self, tensor: torch.Tensor, tag: int) -> None:
        self.pg.recv([tensor], 1 - self.rank, tag).wait(self.timeout)

    def close(self) -> None:
        """Tear the group down (idempotent; a failed group may refuse: dropped anyway)."""
        try:
            self.pg.abort() if self.backend == "nccl" else self.pg.shutdown()
        except RuntimeError:
            pass


class StagingBuffer:
    """A grow-only contiguous buffer a pair sends from or receives into, so a pull does not
    allocate (and page-fault) a fresh tensor the size of its KV each time. Holds the largest
    pull's bytes until the pair's group is closed."""

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None

    def view(self, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
        """A contiguous tensor of `shape` and `dtype` over the buffer (valid until the next)."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        flat = self._flat
        if flat is None or flat.numel() < nbytes or flat.device != torch.device(device):
            flat = self._flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return flat[:nbytes].view(dtype).view(shape)
