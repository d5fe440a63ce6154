"""The one-node KV data paths' units: shared-memory segments (private, exclusive, token-checked,
swept once their owner is dead) and the choice of a data path from a handshake."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
import torch

from services.engine.errors import KVHandshakeError
from services.kv_transfer.registry import choose
from services.kv_transfer.shared_memory.segment import (
    SharedSegment,
    segment_name,
    sweep_dead_segments,
)


def test_a_segment_is_private_exclusive_and_shares_its_bytes(tmp_path):
    segment = SharedSegment.create("engine-a", 4096 * 3, directory=tmp_path)
    assert stat.S_IMODE(os.stat(segment.path).st_mode) == 0o600
    assert segment.name == segment_name("engine-a")
    with pytest.raises(FileExistsError):  # O_EXCL: never reuses a name
        SharedSegment.create("engine-a", 4096, directory=tmp_path)
    data = segment.tensor((3, 1024), torch.float32)
    data.copy_(torch.arange(3 * 1024, dtype=torch.float32).view(3, 1024))
    reader = SharedSegment.open(segment.name, segment.token, segment.nbytes, directory=tmp_path)
    assert torch.equal(reader.tensor((3, 1024), torch.float32), data)
    segment.unlink()
    assert not segment.path.exists()


def test_a_reader_refuses_a_wrong_token_size_or_mode(tmp_path):
    segment = SharedSegment.create("engine-b", 8192, directory=tmp_path)
    with pytest.raises(OSError, match="not the segment the source offered"):
        SharedSegment.open(segment.name, b"x" * 32, 8192, directory=tmp_path)
    with pytest.raises(OSError, match="holds"):
        SharedSegment.open(segment.name, segment.token, 4096, directory=tmp_path)
    os.chmod(segment.path, 0o644)
    with pytest.raises(OSError, match="not private"):
        SharedSegment.open(segment.name, segment.token, 8192, directory=tmp_path)
    with pytest.raises(OSError, match="not a pdserve KV segment"):
        SharedSegment.open("../etc/passwd", segment.token, 8192, directory=tmp_path)


def test_the_sweep_removes_only_segments_of_dead_processes(tmp_path):
    alive = SharedSegment.create("engine-c", 4096, directory=tmp_path)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    orphan = tmp_path / segment_name("engine-d", pid=int(dead.stdout))
    orphan.write_bytes(b"\0" * 4096)
    (tmp_path / "unrelated").write_bytes(b"")
    assert sweep_dead_segments(tmp_path) == [orphan.name]
    assert alive.path.exists() and (tmp_path / "unrelated").exists()


def test_a_mapping_knows_when_its_owner_is_gone(tmp_path):
    """A reader's mapping outlives the owner; `owner_alive` is what the shared-memory path checks
    before trusting a copy (a successor at the address could confirm it otherwise)."""
    script = (
        "import sys; from pathlib import Path; "
        "from services.kv_transfer.shared_memory.segment import SharedSegment; "
        f"s = SharedSegment.create('engine-e', 4096, directory=Path({str(tmp_path)!r})); "
        "s.tensor((1024,), __import__('torch').float32).fill_(7.0); "
        "print(s.name, s.token.hex(), flush=True); sys.stdin.readline()"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    name, token = owner.stdout.readline().split()
    reader = SharedSegment.open(name, bytes.fromhex(token), 4096, directory=tmp_path)
    assert reader.owner_pid == owner.pid and reader.owner_alive()
    owner.kill()
    owner.wait()
    assert not reader.owner_alive()
    assert float(reader.tensor((1024,), torch.float32)[0]) == 7.0  # the pages are still there


@pytest.mark.parametrize(
    ("wanted", "offered", "opens", "local", "source", "same_node", "chosen"),
    [
        ("auto", ("shared_memory", "torch_dist"), True, "cpu", "cpu", True, "shared_memory"),
        ("auto", ("shared_memory", "torch_dist"), False, "cpu", "cpu", True, "grpc"),
        ("auto", ("torch_dist",), False, "cuda", "cuda", True, "torch_dist"),
        ("auto", ("torch_dist",), False, "cuda", "cuda", False, "grpc"),  # another node
        ("torch_dist", ("torch_dist",), False, "cpu", "cpu", True, "torch_dist"),  # gloo
        ("grpc", ("shared_memory", "torch_dist"), True, "cpu", "cpu", True, "grpc"),
    ],
)
def test_the_data_path_choice(wanted, offered, opens, local, source, same_node, chosen):
    assert choose(wanted, offered, opens, local, source, same_node) == chosen


def test_a_forced_path_that_cannot_be_used_fails_naming_the_flag():
    with pytest.raises(KVHandshakeError, match="--kv-transfer-backend shared_memory: the source"):
        choose("shared_memory", (), False, "cpu", "cpu", True)
    with pytest.raises(KVHandshakeError, match="--kv-transfer-backend torch_dist: it cannot"):
        choose("torch_dist", ("torch_dist",), False, "cpu", "cpu", False)


@pytest.mark.parametrize(
    ("wanted", "ipc_opens", "same_node", "chosen"),
    [
        ("auto", True, True, "cuda_ipc"),  # one GPU, or peers: device to device
        ("auto", False, True, "torch_dist"),  # no peer access: NCCL
        ("auto", False, False, "grpc"),
        ("cuda_ipc", True, True, "cuda_ipc"),
    ],
)
def test_the_choice_between_gpu_paths(wanted, ipc_opens, same_node, chosen):
    offered = ("cuda_ipc", "torch_dist")
    assert choose(wanted, offered, False, "cuda", "cuda", same_node, ipc_opens) == chosen


def test_a_forced_cuda_ipc_path_that_does_not_map_fails_naming_the_flag():
    with pytest.raises(KVHandshakeError, match="--kv-transfer-backend cuda_ipc: it cannot"):
        choose("cuda_ipc", ("cuda_ipc",), False, "cuda", "cuda", True, False)


def test_what_a_prefill_worker_offers():
    from services.kv_transfer.registry import offered as offered_backends
    from services.kv_transfer.sender import KVSender

    plain = KVSender(5.0)
    assert offered_backends("auto", plain, "cuda:0") == ("grpc", "cuda_ipc", "torch_dist")
    assert offered_backends("auto", plain, "cpu") == ("grpc", "torch_dist")
    assert offered_backends("grpc", plain, "cuda") == ("grpc",)
    with pytest.raises(ValueError, match="^kv_transfer_backend: cuda_ipc needs the KV cache on"):
        offered_backends("cuda_ipc", plain, "cpu")


def test_a_cuda_ipc_export_round_trips_as_json_and_refuses_what_is_not_one():
    from services.kv_transfer.cuda_ipc.export import CudaIpcExport, export_cuda_kv

    export = CudaIpcExport(
        (0, b"\x01\x02handle", 4096, 0, b"ref", 8, b"event", True),
        (2, 2, 4, 16, 1, 8),
        128,
        "bfloat16",
        "GPU-1234",
        4242,
    )
    assert CudaIpcExport.from_json(export.to_json()) == export
    text = export.to_json()
    for bad in (
        text.replace('"bfloat16"', '"os.system"'),
        text.replace('"kinds": ["i"', '"kinds": ["x"'),
        text.replace("[2, 2, 4, 16, 1, 8]", "[2, 2]"),
    ):
        with pytest.raises(ValueError, match="cuda_ipc: malformed"):
            CudaIpcExport.from_json(bad)
    with pytest.raises(
        ValueError, match="^kv_transfer_backend: cuda_ipc needs the KV cache on CUDA"
    ):
        export_cuda_kv(torch.zeros(2, 2, 1, 1, 1, 1))
