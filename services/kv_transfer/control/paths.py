"""Setting up the data path the registry chose for a source (`open_path`): its segment mapped,
its CUDA IPC handle opened, or its torch.distributed group formed."""

from __future__ import annotations

import logging

import grpc
import torch

from services.common.pb import worker_pb2
from services.engine.errors import KVHandshakeError, KVTransferError
from services.engine.kv_cache import KVCacheSpec
from services.kv_transfer import registry
from services.kv_transfer.base import DataPath
from services.kv_transfer.cuda_ipc.export import CudaIpcExport
from services.kv_transfer.cuda_ipc.receiver import CudaIpcPath
from services.kv_transfer.grpc.receiver import GrpcPath
from services.kv_transfer.handshake import node_id
from services.kv_transfer.shared_memory.receiver import SharedMemoryPath
from services.kv_transfer.shared_memory.segment import SharedSegment
from services.kv_transfer.torch_dist.receiver import TorchDistPath

logger = logging.getLogger(__name__)


def open_path(
    wanted: str,
    reply: worker_pb2.KVHandshakeResponse,
    channel: grpc.Channel,
    address: str,
    spec: KVCacheSpec,
    device: str,
    timeout_s: float,
    engine_id: str,
) -> DataPath:
    """The data path to the source that sent handshake `reply` (`registry.choose`), set up: its
    segment mapped, or its group formed (under "auto", a group that fails to form falls back to
    gRPC with a warning). `device`: where the local KV cache lives; `timeout_s`: the longest one
    pull may take; `engine_id`: the local engine's. Raises KVHandshakeError for a forced path
    that cannot be used."""
    offered, segment = tuple(reply.backends), None
    if "shared_memory" in offered and wanted in ("auto", "shared_memory"):
        offer = reply.shared_memory
        try:
            segment = SharedSegment.open(offer.name, offer.token, offer.nbytes)
        except OSError as exc:  # another host, or another user: not shared
            logger.info("cannot map %s's KV segment %s: %s", address, offer.name, exc)
    local = torch.device(device)
    ipc = None
    same_node = reply.node_id == node_id()
    if "cuda_ipc" in offered and wanted in ("auto", "cuda_ipc") and local.type == "cuda":
        ipc = _open_cuda_ipc(channel, address, reply.cuda_ipc, spec, local, timeout_s)
    name = registry.choose(
        wanted,
        offered,
        segment is not None,
        local.type,
        reply.device_type or "cpu",
        same_node,
        cuda_ipc_opens=ipc is not None and same_node,
    )
    if name == "shared_memory" and segment is not None:
        return SharedMemoryPath(
            channel, address, segment, spec, reply.shared_memory.num_blocks, timeout_s
        )
    if name == "cuda_ipc" and ipc is not None:
        return ipc
    if name == "torch_dist":
        path = TorchDistPath(channel, address, spec, device, timeout_s, engine_id)
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
