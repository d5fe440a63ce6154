"""CUDA IPC moves KV bytes exactly between two processes: a child process owns a KV cache on
the GPU and exports it (`export_cuda_kv`, JSON); this process maps it and gathers blocks, both
with the raw mapping and through the decode side's `CudaIpcPath` (its shape check and the
views it yields, up to but not including its ConfirmKVCopy call, which needs a source worker)."""

from __future__ import annotations

import itertools
import multiprocessing as mp
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.gpu.models import DEVICE, DTYPE, GPU

pytestmark = GPU

SHAPE = (2, 2, 16, 16, 2, 64)  # [layers, K/V, blocks, block_size, kv_heads, head_dim]
BLOCKS = [3, 0, 15, 7, 8, 9]


def _export_child(conn: Any) -> None:
    from services.kv_transfer.cuda_ipc.export import export_cuda_kv

    torch.manual_seed(1)
    kv = torch.randn(*SHAPE, device=DEVICE).to(DTYPE)
    conn.send((export_cuda_kv(kv).to_json(), kv.cpu().view(torch.int16)))
    conn.recv()  # keep the cache alive until the parent has copied


@pytest.fixture
def exported() -> Iterator[tuple[Any, torch.Tensor, int]]:
    """(the child's export, its cache's bytes as int16 on the CPU, the child's pid)."""
    from services.kv_transfer.cuda_ipc.export import CudaIpcExport

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_export_child, args=(child,), daemon=True)
    proc.start()
    try:
        text, expected = parent.recv()
        yield CudaIpcExport.from_json(text), expected, proc.pid
        parent.send("done")
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def test_cuda_ipc_moves_kv_bytes_exactly_between_two_processes(exported) -> None:
    from services.kv_transfer.cuda_ipc.export import cuda_topology, open_cuda_kv

    export, expected, pid = exported
    assert export.owner_pid == pid
    mapped = open_cuda_kv(export, torch.device(DEVICE, 0))
    blocks = torch.tensor(BLOCKS, device=DEVICE)
    local = torch.empty(*SHAPE[:2], len(BLOCKS), *SHAPE[3:], dtype=DTYPE, device=DEVICE)
    torch.index_select(mapped, 2, blocks, out=local)
    torch.cuda.synchronize()
    assert torch.equal(local.cpu().view(torch.int16), expected[:, :, BLOCKS])
    print(f"  {cuda_topology()}")


def test_cuda_ipc_path_yields_the_source_blocks_exactly(exported) -> None:
    try:
        import grpc

        from services.kv_transfer.cuda_ipc.receiver import CudaIpcPath
    except (ImportError, RuntimeError) as exc:  # named in advance: the stubs need grpcio >=
        # theirs (RuntimeError from the stubs' version check); gpu_check.sh installs a grpcio
        # wheel carried in .whl/ (the lent H200's image had 1.84.0, the stubs need 1.85.1)
        pytest.skip(f"the gRPC stubs do not import here ({exc})")
    from services.engine.kv_cache import KVCacheSpec, block_runs
    from services.kv_transfer.handle import KVHandle

    export, expected, _ = exported
    layers, _, _, block_size, kv_heads, head_dim = SHAPE
    spec = KVCacheSpec(layers, kv_heads, head_dim, block_size, DTYPE)
    channel = grpc.insecure_channel("127.0.0.1:9")  # never called: the confirm is not reached
    path = CudaIpcPath(channel, "127.0.0.1:9", export, spec, torch.device(DEVICE, 0), 5.0)
    handle = KVHandle("req-1", "engine-x", tuple(BLOCKS), len(BLOCKS) * block_size, 42)
    local = torch.zeros(*SHAPE[:2], len(BLOCKS), *SHAPE[3:], dtype=DTYPE, device=DEVICE)
    runs = len(block_runs(BLOCKS))
    for offset, view in itertools.islice(path.stream(handle, 0, None), runs):
        local[:, :, offset : offset + view.shape[2]].copy_(view)
    torch.cuda.synchronize()
    assert torch.equal(local.cpu().view(torch.int16), expected[:, :, BLOCKS])
    channel.close()
