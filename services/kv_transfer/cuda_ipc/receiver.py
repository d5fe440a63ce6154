"""The CUDA IPC data path, receiver side: the source's GPU cache mapped through its IPC handle,
copied device to device under the same optimistic copy + ConfirmKVCopy as shared memory."""

from __future__ import annotations

import grpc
import torch

from services.engine.errors import KVTransferError
from services.engine.kv_cache import KVCacheSpec
from services.kv_transfer.cuda_ipc.export import CudaIpcExport, open_cuda_kv
from services.kv_transfer.shared_memory.receiver import MappedCachePath


class CudaIpcPath(MappedCachePath):
    """The cache in the source's GPU memory through a CUDA IPC handle (same GPU, or GPUs with
    peer access: the copies go device to device, over NVLink where there is one)."""

    name = "cuda_ipc"

    def __init__(
        self,
        channel: grpc.Channel,
        address: str,
        export: CudaIpcExport,
        spec: KVCacheSpec,
        local_device: torch.device,
        timeout_s: float,
    ) -> None:
        kv = open_cuda_kv(export, local_device)
        want = (spec.num_layers, 2, kv.shape[2], spec.block_size, spec.num_kv_heads, spec.head_dim)
        if tuple(kv.shape) != want or kv.dtype != spec.dtype:
            raise KVTransferError(f"cuda_ipc: {address}'s cache is {tuple(kv.shape)} {kv.dtype}")
        super().__init__(channel, address, kv, export.owner_pid, timeout_s)
