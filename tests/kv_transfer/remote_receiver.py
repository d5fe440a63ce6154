"""A `KVReceiver` that lives in a second, real process (multiprocessing "spawn"), driven over a
pipe: the contract suite runs a backend's two ends in two processes with it, so a shared-memory
segment is really mapped by another process and a torch.distributed group really spans two.
Exceptions come back as their own types, `reason` included."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from multiprocessing.connection import Connection

from services.engine.errors import EngineError, KVTransferError
from services.kv_transfer.base import KVReceiver
from services.kv_transfer.handle import KVHandle
from services.kv_transfer.handshake import KVPeerInfo


def _serve(conn: Connection) -> None:
    from services.kv_transfer.control.receiver import GrpcKVReceiver

    receiver = None
    while True:
        method, args = conn.recv()
        try:
            if method == "new":
                if receiver is not None:
                    receiver.close()
                name, kwargs = args
                receiver = GrpcKVReceiver(backend=name, **kwargs)
                result = None
            elif method == "pull":  # as a decode worker: handshake (once), then pull
                handle, first_block, local = args
                receiver.connect(handle, local)
                result = receiver.pull(handle, first_block)
            elif method == "path":  # the data path the handshake chose for a source
                result = receiver._path(*args).name
            elif method == "hold":  # take the first piece of a pull, then never ask for more
                handle, first_block, local = args
                receiver.connect(handle, local)
                next(receiver.pull_chunks(handle, first_block))
                conn.send((True, None))
                time.sleep(3600)
            else:
                result = getattr(receiver, method)(*args)
        except Exception as exc:  # noqa: BLE001 - sent back to the caller, who raises it
            conn.send((False, (type(exc), str(exc), getattr(exc, "reason", None))))
        else:
            conn.send((True, result))


class ProcessReceiver(KVReceiver):
    """A `GrpcKVReceiver` over data path `name`, made with `kwargs` in a child process (one child
    serves one receiver at a time; `renew(name, local, **kwargs)` replaces it). Its `pull`
    handshakes first, with `local` (the destination's KVPeerInfo), as a decode worker does."""

    local: KVPeerInfo

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child,), daemon=True)
        self.process.start()

    def renew(self, name: str, local: KVPeerInfo, **kwargs) -> None:
        self.local = local
        self._call("new", name, kwargs)

    def _call(self, method: str, *args):
        self._conn.send((method, args))
        ok, value = self._conn.recv()
        if ok:
            return value
        kind, message, reason = value
        if issubclass(kind, EngineError):
            exc = kind.__new__(kind)
            Exception.__init__(exc, message)
            if isinstance(exc, KVTransferError):
                exc.reason = reason
            raise exc
        raise kind(message)

    def set_source(self, request_id: str, address: str) -> None:
        self._call("set_source", request_id, address)

    def connect(self, handle: KVHandle, local: KVPeerInfo) -> None:
        self._call("connect", handle, local)

    def is_ready(self, handle: KVHandle) -> bool:
        return False

    def pull(self, handle: KVHandle, first_block: int = 0):
        return self._call("pull", handle, first_block, self.local)

    def hold(self, handle: KVHandle, first_block: int = 0) -> None:
        """Start a pull and stop after its first piece, holding the rest (then `kill` it)."""
        self._call("hold", handle, first_block, self.local)

    def path_name(self, address: str, engine_id: str) -> str:
        return self._call("path", address, engine_id)

    def complete(self, handle: KVHandle) -> None:
        self._call("complete", handle)

    def kill(self) -> None:
        """SIGKILL the child process."""
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def close(self) -> None:
        self.kill()
