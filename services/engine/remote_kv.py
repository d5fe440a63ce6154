"""DECODE role: requests whose prompt KV comes through a transfer, inside one engine.

`kv_reservations.py` reserves their blocks; this module hands each reservation out
(`take_reserved`), tells the scheduler which reserved requests are ready to run,
lets a caller claim the writing of the pulled KV into the reserved blocks (off the engine thread:
the decode worker's RPC thread writes each chunk as it arrives), loads the KV itself at
admission when nobody claimed it, and makes sure blocks a caller may still be writing are never
freed under it: a request that ends meanwhile is kept aside until the writer reports back.
"""

from __future__ import annotations

from services.engine.errors import InvalidRequestError, KVTransferError, RequestNotFoundError
from services.engine.kv_cache import KVCache
from services.engine.kv_reservations import KVReservations
from services.engine.outputs import KVReserved
from services.engine.request import Request, RequestStatus
from services.engine.scheduler import RemoteLoad
from services.kv_transfer.base import KVReceiver


class RemoteKV:
    """Reservations, claimed writes and admission-time loads of one DECODE engine (engine
    thread)."""

    def __init__(
        self, kv_cache: KVCache, reservations: KVReservations, receiver: KVReceiver
    ) -> None:
        self.kv_cache = kv_cache
        self.reservations = reservations
        self.receiver = receiver
        self._writing: set[str] = set()  # requests whose KV a caller is writing (claimed)
        self._abandoned: dict[str, Request] = {}  # ended while claimed: freed at `written`

    def take_reserved(self, claim_writes: bool) -> list[KVReserved]:
        """See `Engine.take_reserved`."""
        reserved = []
        for request in self.reservations.take_new():
            num_blocks = len(request.remote_handle.block_ids)
            block_ids = tuple(request.block_table[request.kv_first_block : num_blocks])
            reserved.append(KVReserved(request.request_id, request.kv_first_block, block_ids))
            if claim_writes:
                self._writing.add(request.request_id)
        return reserved

    def is_claimed(self, request_id: str) -> bool:
        """Whether a caller claimed `request_id`'s writes and has not reported back."""
        return request_id in self._writing

    def written(self, request_id: str, request: Request | None, ok: bool) -> None:
        """The caller that claimed `request_id`'s writes is done; `ok`: all of it landed."""
        self._writing.discard(request_id)
        abandoned = self._abandoned.pop(request_id, None)
        if abandoned is not None:
            self.kv_cache.free(abandoned)
        elif ok and request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            request.kv_landed = True

    def ready(self, request: Request) -> bool:
        """Whether a reserved request may be admitted: its KV landed, the local prefix cache
        holds it all, or the transfer can serve it now and nobody claimed the writing."""
        if request.kv_landed or request.kv_first_block >= len(request.remote_handle.block_ids):
            return True
        return request.request_id not in self._writing and self.receiver.is_ready(
            request.remote_handle
        )

    def ready_requests(self) -> list[Request]:
        """Reserved requests that may join the running batch now, in arrival order."""
        return [r for r in self.reservations.reserved if self.ready(r)]

    def has_ready_work(self) -> bool:
        """A reserved request is ready, or one is past its KV deadline."""
        return bool(self.ready_requests() or self.reservations.timed_out())

    def end(self, request: Request, status: RequestStatus) -> None:
        """End a request whose KV never loaded: let the source unpin, and free the blocks now
        or, while a caller writes into them, when it reports back."""
        self.receiver.complete(request.remote_handle)
        request.finish(status)
        self.reservations.remove(request)
        if request.request_id in self._writing:
            self._abandoned[request.request_id] = request
        else:
            self.kv_cache.free(request)

    def load(self, loads: list[RemoteLoad], requests: dict[str, Request]) -> list[Request]:
        """At admission: pull (unless a caller already wrote it) and write each request's prompt
        KV, then let the source unpin. Returns the requests whose KV could not be loaded (the
        source released or lost it, or sent another layout); the caller ends them."""
        failed = []
        for load in loads:
            request = requests[load.request_id]
            try:
                if not request.kv_landed:
                    self._pull_into(load)
            except (RequestNotFoundError, InvalidRequestError, KVTransferError):
                failed.append(request)
            self.receiver.complete(load.handle)
        self.reservations.started([requests[load.request_id] for load in loads])
        return failed

    def _pull_into(self, load: RemoteLoad) -> None:
        num_blocks, block = len(load.handle.block_ids), load.first_block
        pieces = self.receiver.pull(load.handle, block) if block < num_blocks else []
        for piece in pieces:
            block = self.kv_cache.write_transferred(load.block_ids[:num_blocks], block, piece)
        if block != num_blocks:
            raise InvalidRequestError(
                "kv_handle", f"the pull covered {block} of {num_blocks} blocks"
            )

    @property
    def abandoned(self) -> list[Request]:
        """Ended requests whose blocks wait for their writer (they still hold those blocks)."""
        return list(self._abandoned.values())
