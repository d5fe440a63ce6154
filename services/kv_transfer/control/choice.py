"""Which data path a decode worker takes to a source: `choose`, from what the source's handshake
offers, where both caches live, and `--kv-transfer-backend`."""

from __future__ import annotations

import functools
import logging
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import grpc
import torch

from services.common.pb import worker_pb2
from services.engine.errors import KVHandshakeError, KVTransferError
from services.engine.kv_cache import KVCacheSpec
from services.kv_transfer.cuda_ipc.export import CudaIpcExport
from services.kv_transfer.grpc.receiver import GrpcPath
from services.kv_transfer.handle import KVHandle
from services.kv_transfer.shared_memory.receiver import CudaIpcPath, SharedMemoryPath
from services.kv_transfer.shared_memory.segment import SharedSegment
from services.kv_transfer.torch_dist.receiver import TorchDistPath

if TYPE_CHECKING:
    from services.kv_transfer.control.receiver import GrpcKVReceiver

logger = logging.getLogger(__name__)


class DataPath(Protocol):
    """How one source's blocks reach this worker (`GrpcPath`, `SharedMemoryPath`,
    `TorchDistPath`): `stream` yields (block offset from `first_block`, piece) in order."""

    name: str

    def stream(
        self, handle: KVHandle, first_block: int, on_call: Callable[..., object] | None
    ) -> Iterator[tuple[int, torch.Tensor]]: ...

    def close(self) -> None: ...


@functools.cache
def node_id() -> str:
    """This machine's boot id (two workers with the same one share a node), else its host name."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def choose(
    wanted: str,
    offered: tuple[str, ...],
    shared_memory_opens: bool,
    local_device: str,
    source_device: str,
    same_node: bool,
    cuda_ipc_opens: bool = False,
) -> str:
    """The data path to a source: `wanted` ("auto", or the one the flag forces) among the ones
    it `offered`. "auto" takes shared memory when the segment mapped (`shared_memory_opens`: same
    host, same user), CUDA IPC when the source's device memory mapped (`cuda_ipc_opens`: the
    same GPU or a peer), torch.distributed when both caches are on CUDA devices of one node,
    gRPC otherwise. Raises KVHandshakeError naming `--kv-transfer-backend` when a forced path cannot
    be used."""
    usable = {
        "grpc": True,
        "shared_memory": "shared_memory" in offered and shared_memory_opens,
        "cuda_ipc": "cuda_ipc" in offered and cuda_ipc_opens,
        "torch_dist": "torch_dist" in offered
        and same_node
        and (local_device == source_device)
        and (local_device in ("cpu", "cuda")),
    }
    if wanted != "auto":
        if not usable.get(wanted, False):
            why = "the source does not offer it" if wanted not in offered else "it cannot reach it"
            raise KVHandshakeError(
                f"--kv-transfer-backend {wanted}: {why} (offered: {', '.join(('grpc', *offered))})"
            )
        return wanted
    if usable["shared_memory"]:
        return "shared_memory"
    if usable["cuda_ipc"]:
        return "cuda_ipc"
    if usable["torch_dist"] and local_device == "cuda":
        return "torch_dist"
    return "grpc"


def open_path(
    wanted: str,
    reply: worker_pb2.KVHandshakeResponse,
    channel: grpc.Channel,
    address: str,
    spec: KVCacheSpec,
    receiver: GrpcKVReceiver,
) -> DataPath:
    """The data path to the source that sent handshake `reply` (`choose`), set up: its segment
    mapped, or its group formed (under "auto", a group that fails to form falls back to gRPC
    with a warning). Raises KVHandshakeError for a forced path that cannot be used."""
    offered, segment = tuple(reply.backends), None
    if "shared_memory" in offered and wanted in ("auto", "shared_memory"):
        offer = reply.shared_memory
        try:
            segment = SharedSegment.open(offer.name, offer.token, offer.nbytes)
        except OSError as exc:  # another host, or another user: not shared
            logger.info("cannot map %s's KV segment %s: %s", address, offer.name, exc)
    local = torch.device(receiver.device)
    ipc = None
    same_node = reply.node_id == node_id()
    if "cuda_ipc" in offered and wanted in ("auto", "cuda_ipc") and local.type == "cuda":
        ipc = _open_cuda_ipc(channel, address, reply.cuda_ipc, spec, local, receiver.timeout_s)
    name = choose(
        wanted,
        offered,
        segment is not None,
        local.type,
        reply.device_type or "cpu",
        same_node,
        cuda_ipc_opens=ipc is not None and same_node,
    )
    timeout_s = receiver.timeout_s
    if name == "shared_memory" and segment is not None:
        return SharedMemoryPath(
            channel, address, segment, spec, reply.shared_memory.num_blocks, timeout_s
        )
    if name == "cuda_ipc" and ipc is not None:
        return ipc
    if name == "torch_dist":
        path = TorchDistPath(channel, address, spec, receiver.device, timeout_s, receiver.engine_id)
        try:
            path.open()
        except KVTransferError as exc:
            if wanted != "auto":
                raise KVHandshakeError(f"--kv-transfer-backend torch_dist: {exc}") from None
            logger.warning("%s; KV from %s takes gRPC", exc, address)
            return GrpcPath(channel, address, timeout_s)
        return path
    return GrpcPath(channel, address, timeout_s)


def _open_cuda_ipc(channel, address, export_json, spec, local, timeout_s) -> CudaIpcPath | None:
    """The CUDA IPC path to a source's cache, or None (logged) where it does not map here."""
    try:
        export = CudaIpcExport.from_json(export_json)
        return CudaIpcPath(channel, address, export, spec, local, timeout_s)
    except (ValueError, RuntimeError, KVTransferError) as exc:  # another node, no peer access
        logger.info("cannot map %s's KV cache over CUDA IPC: %s", address, exc)
        return None
