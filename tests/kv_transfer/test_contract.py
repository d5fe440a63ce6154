"""The KV-transfer contract, run by every backend: what a `KVSender` and a backend's `KVReceiver`
promise each other (services/kv_transfer/base.py). A new backend adds a fixture param
and must pass these unchanged: publish, pull, partial pull, complete, lease expiry, revoke,
handshake refusal, dead peer."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from services.common.grpc_server import start_service
from services.engine import EngineRole, SamplingParams
from services.engine.errors import KVHandshakeError, KVTransferError, RequestNotFoundError
from services.kv_transfer import registry
from services.kv_transfer.base import KVReceiver
from services.kv_transfer.control.receiver import GrpcKVReceiver
from services.kv_transfer.control.service import KVTransferServicer, add_kv_transfer_servicer
from services.kv_transfer.handle import KVHandle
from services.kv_transfer.in_memory import InMemoryKVReceiver
from services.kv_transfer.lease import TransferStatus
from services.kv_transfer.sender import KVSender
from services.kv_transfer.shared_memory.segment import count_segments
from services.kv_transfer.shared_memory.source import SharedMemoryKVSender
from tests.engine.helpers import GREEDY, make_engine
from tests.kv_transfer.remote_receiver import ProcessReceiver
from tests.kv_transfer.test_lease import FakeClock

LEASE_S = 5.0


@dataclasses.dataclass
class Backend:
    """One backend's two ends around a PREFILL engine, and how to drive them."""

    name: str
    prefill: object  # the PREFILL Engine whose sender publishes
    sender: KVSender
    receiver: KVReceiver
    clock: FakeClock  # the sender's lease clock
    want: Callable[[KVHandle], None]  # tell the receiver where a handle's KV lives
    kill: Callable[[], None]  # the source side dies
    address: str = ""  # the source's KVTransfer service, if it has one
    groups: Callable[[], int] = lambda: 0  # torch.distributed groups the source holds open

    def publish(self, request_id: str, num_tokens: int = 37) -> KVHandle:
        prompt = list(range(3, 3 + num_tokens))
        self.prefill.add_request(
            prompt, SamplingParams(max_tokens=4, **GREEDY), request_id=request_id
        )
        (out,) = self.prefill.step()
        self.want(out.kv_handle)
        return out.kv_handle


Ends = Iterator[tuple[KVReceiver, Callable, Callable, str, Callable[[], int]]]


def _in_memory(name, prefill, sender) -> Ends:
    yield InMemoryKVReceiver(sender), lambda handle: None, sender.close, "", lambda: 0


def _service(prefill, sender):
    block_bytes = prefill.kv_cache.spec.bytes_per_block
    servicer = KVTransferServicer(
        sender,
        lambda fn: fn(),
        prefill.kv_peer_info,
        chunk_bytes=3 * block_bytes,
        backends=("shared_memory", "torch_dist"),
        group_timeout_s=5,
    )
    service = start_service(
        "prefill",
        [(add_kv_transfer_servicer, servicer, "pdserve.v1.KVTransfer")],
        "127.0.0.1",
        0,
        0,
    )
    return servicer, service


def _grpc(name, prefill, sender) -> Ends:
    """Both ends in this process (the gRPC path is also in `_remote`'s two-process runs)."""
    _, service = _service(prefill, sender)
    receiver = GrpcKVReceiver(timeout_s=5)
    try:
        yield (
            receiver,
            lambda h: receiver.set_source(h.request_id, service.grpc_address),
            lambda: service.server.stop(0).wait(),
            service.grpc_address,
            lambda: 0,
        )
    finally:
        receiver.close()
        service.server.stop(0)


_CHILDREN: dict[str, ProcessReceiver] = {}


def _remote(name, prefill, sender) -> Ends:
    """The receiver in a second process (one per backend, kept across tests while it lives),
    the source here."""
    servicer, service = _service(prefill, sender)
    receiver = _CHILDREN.get(name)
    if receiver is None or not receiver.process.is_alive():
        receiver = _CHILDREN[name] = ProcessReceiver()
    backend = name.removeprefix("remote_")
    receiver.renew(backend, prefill.kv_peer_info, engine_id="decode-under-test", timeout_s=5)

    def kill() -> None:
        service.server.stop(0).wait()
        servicer.close_groups()

    try:
        yield (
            receiver,
            lambda h: receiver.set_source(h.request_id, service.grpc_address),
            kill,
            service.grpc_address,
            lambda: len(servicer.groups),
        )
    finally:
        servicer.close_groups()
        service.server.stop(0)


BACKENDS = {
    "in_memory": _in_memory,
    "grpc": _grpc,
    "remote_grpc": _remote,
    "remote_shared_memory": _remote,
    "remote_torch_dist": _remote,
}


# Receivers whose data path needs a GPU: their contract runs in tests/gpu (CUDA IPC bytes
# exact between two processes), not here.
CUDA_ONLY = {"cuda_ipc"}


def test_every_registered_data_path_runs_the_contract():
    paths = set(registry.DATA_PATHS) - CUDA_ONLY
    assert {n.removeprefix("remote_") for n in BACKENDS if n.startswith("remote_")} == paths
    assert set(registry.KV_TRANSFER_BACKENDS) == {"auto", *registry.DATA_PATHS}


@contextlib.contextmanager
def _backend(name: str, model: str, **engine) -> Iterator[Backend]:
    clock = FakeClock()
    shared = name == "remote_shared_memory"
    sender = (SharedMemoryKVSender if shared else KVSender)(LEASE_S, clock)
    prefill = make_engine(
        model, role=EngineRole.PREFILL, num_blocks=128, block_size=4, kv_sender=sender, **engine
    )
    ends = BACKENDS[name](name, prefill, sender)
    receiver, want, kill, address, groups = next(ends)
    try:
        yield Backend(name, prefill, sender, receiver, clock, want, kill, address, groups)
    finally:
        ends.close()
        sender.close()


@pytest.fixture(params=sorted(BACKENDS))
def backend(request, tiny_llama) -> Iterator[Backend]:
    with _backend(request.param, tiny_llama) as backend:
        yield backend


@pytest.fixture(scope="module", autouse=True)
def _stop_children():
    yield
    for child in _CHILDREN.values():
        child.close()


def _wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_publish_pull_complete_frees_the_pin(backend):
    pool = backend.prefill.kv_cache.pool
    handle = backend.publish("r")
    assert backend.sender.status("r") == TransferStatus.PUBLISHED
    assert backend.prefill.num_pinned_blocks == len(handle.block_ids) == 10
    backend.receiver.connect(handle, backend.prefill.kv_peer_info)
    pieces = backend.receiver.pull(handle)
    assert torch.equal(torch.cat(pieces, dim=2), backend.prefill.export.read_kv(handle))
    if isinstance(backend.receiver, ProcessReceiver):  # the pull took the backend's own path
        path = backend.receiver.path_name(backend.address, handle.engine_id)
        assert path == backend.name.removeprefix("remote_")
    backend.receiver.complete(handle)
    _wait_for(lambda: backend.sender.status("r") == TransferStatus.COMPLETED)
    assert backend.prefill.num_pinned_blocks == 0
    assert pool.num_free_blocks == pool.num_blocks
    backend.receiver.complete(handle)  # a duplicate completion is harmless
    backend.prefill.check_integrity()


def test_partial_pull_returns_only_the_blocks_from_first_block(backend):
    handle = backend.publish("r")
    whole = backend.prefill.export.read_kv(handle)
    pieces = backend.receiver.pull(handle, 4)
    assert sum(p.shape[2] for p in pieces) == len(handle.block_ids) - 4
    assert torch.equal(torch.cat(pieces, dim=2), whole[:, :, 4:])


def test_a_lapsed_lease_frees_the_blocks_and_later_pulls_find_nothing(backend):
    handle = backend.publish("r")
    backend.clock.now += LEASE_S - 1
    assert backend.sender.renew("r")  # a renewal pushes the end out
    backend.clock.now += LEASE_S - 1
    assert backend.sender.expire_leases() == []
    backend.clock.now += 2
    assert backend.sender.expire_leases() == ["r"]
    assert backend.sender.status("r") == TransferStatus.EXPIRED
    assert backend.prefill.num_pinned_blocks == 0
    with pytest.raises(RequestNotFoundError):
        backend.receiver.pull(handle)
    assert not backend.sender.renew("r")


def test_a_revoked_transfer_frees_the_blocks_and_later_pulls_find_nothing(backend):
    handle = backend.publish("r")
    backend.prefill.abort("r")  # its client went away
    assert backend.sender.status("r") == TransferStatus.REVOKED
    assert backend.prefill.num_pinned_blocks == 0
    with pytest.raises(RequestNotFoundError):
        backend.receiver.pull(handle)


def test_handshake_refuses_another_layout_naming_the_field(backend):
    handle = backend.publish("r")
    info = backend.prefill.kv_peer_info
    local = dataclasses.replace(info, spec=dataclasses.replace(info.spec, block_size=8))
    with pytest.raises(KVHandshakeError, match="block_size: 4 at the source.*8 at the destination"):
        backend.receiver.connect(handle, local)
    backend.receiver.connect(handle, backend.prefill.kv_peer_info)  # the same layout is fine


def test_a_dead_source_is_unavailable_not_a_hang(backend):
    handle = backend.publish("r")
    backend.kill()
    start = time.monotonic()
    with pytest.raises(KVTransferError) as failure:
        backend.receiver.pull(handle)
    assert failure.value.reason == "unavailable"
    assert time.monotonic() - start < 5


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", ["remote_grpc", "remote_shared_memory", "remote_torch_dist"])
def test_bytes_round_trip_exactly_in_every_dtype_between_two_processes(name, dtype, tiny_llama):
    with _backend(name, tiny_llama, dtype=dtype) as backend:
        handle = backend.publish("r", num_tokens=23)
        want = backend.prefill.export.read_kv(handle)
        assert want.dtype == getattr(torch, dtype)
        got = torch.cat(backend.receiver.pull(handle), dim=2)
        assert got.dtype == want.dtype and torch.equal(_bytes(got), _bytes(want))
        got = torch.cat(backend.receiver.pull(handle, 2), dim=2)
        assert torch.equal(_bytes(got), _bytes(want[:, :, 2:]))


@pytest.mark.parametrize("name", ["remote_shared_memory", "remote_torch_dist"])
def test_a_sigkilled_destination_leaves_no_pin_or_segment(name, tiny_llama):
    """The receiving process dies (SIGKILL) mid-pull: the lease frees the pin, the pair's
    process group is torn down with its OpenKVGroup call, and the source's segment goes with
    its close."""
    before = count_segments()
    with _backend(name, tiny_llama) as backend:
        assert count_segments() == before + (name == "remote_shared_memory")
        handle = backend.publish("r")
        backend.receiver.hold(handle)
        assert backend.groups() == (name == "remote_torch_dist")
        backend.receiver.kill()
        _wait_for(lambda: backend.groups() == 0)
        _wait_for(lambda: backend.sender.status("r") == TransferStatus.PUBLISHED)
        backend.clock.now += LEASE_S + 1
        assert backend.sender.expire_leases() == ["r"]
        assert backend.prefill.num_pinned_blocks == 0
        backend.prefill.check_integrity()
    assert count_segments() == before
