"""The one registry of KV data paths: a backend name, what a source serves for it, which path a
receiver takes, and the class that carries the blocks.

Every data path runs behind the same gRPC control plane (handshake, leases, release:
`services/kv_transfer/control/`). The source side picks its sender (`make_sender`) and says what
it serves (`offered`); the destination picks one path per source (`choose`) from what the
handshake offered, and `control/paths.py` sets the chosen one up. Nothing else decides a
backend.

- grpc: the blocks stream as PullKV messages (any two hosts; the fallback of every other path);
- shared_memory: copied in place out of the source's cache, mapped from its `/dev/shm` segment
  (CPU workers of one host, same user);
- cuda_ipc: copied device to device out of the source's GPU cache (the same GPU or peers);
- torch_dist: sent through a torch.distributed group per prefill/decode pair (NCCL between GPUs
  of one node, which takes NVLink where the GPUs have it; gloo between CPU processes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.kv_transfer.sender import KVSender

KV_TRANSFER_BACKENDS = ("auto", "grpc", "shared_memory", "cuda_ipc", "torch_dist")
"""Values of `--kv-transfer-backend`: "auto" takes shared memory between CPU workers of one
host, CUDA IPC between GPU workers on one GPU or peer GPUs, torch.distributed between other GPU
workers of one node, gRPC otherwise."""

DATA_PATHS = ("grpc", "shared_memory", "cuda_ipc", "torch_dist")
"""The data paths, each a `DataPath` in its own package (`services/kv_transfer/NAME/`)."""

_AUTO_ORDER = ("shared_memory", "cuda_ipc", "torch_dist")


def make_sender(backend: str, device: str, lease_s: float) -> KVSender:
    """The source side a prefill worker runs under `--kv-transfer-backend backend` with its KV
    cache on `device` ("cpu", "cuda", "cuda:1"): its cache in a shared-memory segment where one
    may be mapped (CPU, auto or shared_memory), else a plain `KVSender`; leases of `lease_s`
    seconds."""
    if backend in ("auto", "shared_memory") and device.split(":")[0] == "cpu":
        from services.kv_transfer.shared_memory.source import SharedMemoryKVSender

        return SharedMemoryKVSender(lease_s)
    from services.kv_transfer.sender import KVSender

    return KVSender(lease_s)


def offered(backend: str, sender: KVSender, device: str = "cpu") -> tuple[str, ...]:
    """The data paths a prefill worker serves under `--kv-transfer-backend backend`: gRPC
    always (the fallback), shared memory when its cache is in a segment, CUDA IPC when it is on
    a GPU, torch.distributed. Raises ValueError naming the flag when a forced one cannot be
    served."""
    shared = getattr(sender, "segment", None) is not None
    on_cuda = device.startswith("cuda")
    if backend == "shared_memory" and not shared:
        raise ValueError(
            "kv_transfer_backend: shared_memory needs the KV cache in /dev/shm on the CPU "
            "(see the warning above for why it is not)"
        )
    if backend == "cuda_ipc" and not on_cuda:
        raise ValueError("kv_transfer_backend: cuda_ipc needs the KV cache on CUDA (--device)")
    wanted = {"auto": _AUTO_ORDER, "grpc": ()}.get(backend, (backend,))
    usable = {"shared_memory": shared, "cuda_ipc": on_cuda}
    return ("grpc", *(b for b in wanted if usable.get(b, True)))


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
    gRPC otherwise. Raises KVHandshakeError naming `--kv-transfer-backend` when a forced path
    cannot be used."""
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
            from services.engine.errors import KVHandshakeError

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
