"""CUDA IPC for the KV cache: a prefill worker on a GPU exports its cache's device memory once,
and a decode worker on the same GPU, or on a GPU with peer access to it, maps that memory and
copies a request's pinned blocks straight into its own cache (device to device: over NVLink
where the GPUs have it), with no host copy and no serialization.

The export is the storage's CUDA IPC handle and the ints that locate the cache in it, as
torch.multiprocessing shares CUDA tensors (`UntypedStorage._share_cuda_` /
`_new_shared_cuda`), written as JSON: the receiver rebuilds it field by field and never
unpickles what a peer sent. The exporting process keeps its cache alive for its lifetime; a
mapping must not be trusted once that process is gone (`owner_pid`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CudaIpcExport:
    """Where a cache lives in another process's device memory (JSON on the wire)."""

    share: tuple  # UntypedStorage._share_cuda_(): device, handle, sizes, ref counter, event
    shape: tuple[int, ...]  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    storage_offset: int  # elements from the storage's start
    dtype: str  # "bfloat16", ...
    device_uuid: str  # the exporter's GPU
    owner_pid: int

    def to_json(self) -> str:
        share = [x.hex() if isinstance(x, bytes) else x for x in self.share]
        kinds = ["b" if isinstance(x, bytes) else "i" for x in self.share]
        return json.dumps(
            {
                "share": share,
                "kinds": kinds,
                "shape": list(self.shape),
                "storage_offset": self.storage_offset,
                "dtype": self.dtype,
                "device_uuid": self.device_uuid,
                "owner_pid": self.owner_pid,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> CudaIpcExport:
        """Raises ValueError for anything that is not an export (a peer's bad or hostile
        message: every field is checked for its type)."""
        data = json.loads(text)
        kinds, share = data["kinds"], data["share"]
        if len(kinds) != len(share) or not set(kinds) <= {"b", "i"}:
            raise ValueError("cuda_ipc: malformed share")
        parsed: list[bytes | int] = []
        for kind, value in zip(kinds, share, strict=True):
            if kind == "b":
                parsed.append(bytes.fromhex(str(value)))
            elif isinstance(value, (int, bool)):
                parsed.append(value)
            else:
                raise ValueError("cuda_ipc: malformed share")
        shape = tuple(int(n) for n in data["shape"])
        if len(shape) != 6 or not isinstance(getattr(torch, str(data["dtype"]), None), torch.dtype):
            raise ValueError("cuda_ipc: malformed shape or dtype")
        return cls(
            tuple(parsed),
            shape,
            int(data["storage_offset"]),
            str(data["dtype"]),
            str(data["device_uuid"]),
            int(data["owner_pid"]),
        )


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID (two processes on one GPU see the same one)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def export_cuda_kv(kv: torch.Tensor) -> CudaIpcExport:
    """The export of `kv`, a contiguous CUDA tensor. Raises ValueError for a CPU tensor."""
    if kv.device.type != "cuda":
        raise ValueError(
            f"kv_transfer_backend: cuda_ipc needs the KV cache on CUDA, not {kv.device}"
        )
    assert kv.is_contiguous()
    share = kv.untyped_storage()._share_cuda_()
    return CudaIpcExport(
        tuple(share),
        tuple(kv.shape),
        int(kv.storage_offset()),
        str(kv.dtype).removeprefix("torch."),
        device_uuid(kv.device),
        os.getpid(),
    )


def open_cuda_kv(export: CudaIpcExport, local_device: torch.device) -> torch.Tensor:
    """Map an export into this process: a tensor of its shape on the exporter's GPU (which this
    process must see: the same GPU, or a peer). Raises RuntimeError when CUDA cannot open the
    handle (another node, no peer access) or the GPU is not visible here."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", index)) == export.device_uuid:
            break
    else:
        raise RuntimeError(f"cuda_ipc: the source's GPU {export.device_uuid} is not visible here")
    if index != local_device.index and not torch.cuda.can_device_access_peer(
        local_device.index or 0, index
    ):
        raise RuntimeError(
            f"cuda_ipc: no peer access from cuda:{local_device.index} to cuda:{index}"
        )
    share = (index, *export.share[1:])  # the exporter's device, as this process numbers it
    with torch.cuda.device(index):
        storage = torch.UntypedStorage._new_shared_cuda(*share)
    dtype = getattr(torch, export.dtype)
    tensor = torch.empty(0, dtype=dtype, device=torch.device("cuda", index))
    strides = torch.empty(export.shape, device="meta").stride()  # contiguous
    tensor.set_(storage, export.storage_offset, export.shape, strides)
    return tensor


def cuda_topology() -> str:
    """The GPUs this process sees and which pairs have peer access (what decides cuda_ipc vs
    torch_dist between two GPU workers), for the start-up log."""
    count = torch.cuda.device_count()
    names = [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(count)]
    peers = [
        f"{i}->{j}"
        for i in range(count)
        for j in range(count)
        if i != j and torch.cuda.can_device_access_peer(i, j)
    ]
    return f"{count} GPU(s): {', '.join(names)}; peer access: {', '.join(peers) or 'none'}"
