"""The source side of the shared-memory KV transfer: a `KVSender` whose engine's KV cache lives in a
POSIX shared-memory segment (`kv_transfer/shared_memory/segment.py`) that decode workers on the
same host map read-only and copy from in place, so the KV bytes never cross a socket; gRPC carries
only the control messages (the handshake offers the segment, a pull holds the lease while the
receiver copies). The zero-copy read is what Mooncake's and NIXL's same-host paths do with
registered memory; here plain POSIX shared memory serves CPU workers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from services.kv_transfer.lease import DEFAULT_LEASE_S
from services.kv_transfer.sender import KVSender
from services.kv_transfer.shared_memory.segment import SharedSegment, sweep_dead_segments

logger = logging.getLogger(__name__)


class SharedMemoryKVSender(KVSender):
    """A KVSender whose (CPU) source engine's cache is a shared-memory segment, offered to
    receivers as `segment` (None when the cache is on a GPU, or /dev/shm is missing or too
    small: then only the other backends serve it, and a warning says why). Sweeps dead
    workers' segments when made; `close` unlinks its own."""

    def __init__(
        self, lease_s: float = DEFAULT_LEASE_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(lease_s, clock)
        self.segment: SharedSegment | None = None
        sweep_dead_segments()

    def allocate_kv(
        self, engine_id: str, shape: tuple[int, ...], dtype: torch.dtype, device: str
    ) -> torch.Tensor:
        if torch.device(device).type != "cpu" or self.segment is not None:
            return super().allocate_kv(engine_id, shape, dtype, device)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        try:
            self.segment = SharedSegment.create(engine_id, nbytes)
        except OSError as exc:
            logger.warning(
                "KV cache not in shared memory (%s): decode workers pull it over gRPC", exc
            )
            return super().allocate_kv(engine_id, shape, dtype, device)
        logger.info("KV cache in shared memory %s (%d bytes)", self.segment.path, nbytes)
        return self.segment.tensor(shape, dtype)

    def close(self) -> None:
        super().close()
        if self.segment is not None:
            self.segment.unlink()
