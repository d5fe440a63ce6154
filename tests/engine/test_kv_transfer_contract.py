"""The KV-transfer contract, run by every backend: what a `KVSender` and a backend's `KVReceiver`
promise each other (services/engine/kv_transfer/base.py). A new backend adds a fixture param
and must pass these unchanged: publish, pull, partial pull, complete, lease expiry, revoke,
handshake refusal, dead peer."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from services.common.kv_transfer_grpc import GrpcKVReceiver
from services.common.kv_transfer_service import KVTransferServicer, add_kv_transfer_servicer
from services.common.server import start_service
from services.engine import EngineRole, SamplingParams
from services.engine.errors import KVHandshakeError, KVTransferError, RequestNotFoundError
from services.engine.kv_transfer.base import RECEIVERS, KVReceiver
from services.engine.kv_transfer.handle import KVHandle
from services.engine.kv_transfer.in_memory import InMemoryKVReceiver
from services.engine.kv_transfer.lease import TransferStatus
from services.engine.kv_transfer.sender import KVSender
from tests.engine.helpers import GREEDY, make_engine
from tests.engine.test_kv_lease import FakeClock

LEASE_S = 5.0


@dataclasses.dataclass
class Backend:
    """One backend's two ends around a PREFILL engine, and how to drive them."""

    prefill: object  # the PREFILL Engine whose sender publishes
    sender: KVSender
    receiver: KVReceiver
    clock: FakeClock  # the sender's lease clock
    want: Callable[[KVHandle], None]  # tell the receiver where a handle's KV lives
    kill: Callable[[], None]  # the source side dies

    def publish(self, request_id: str, num_tokens: int = 37) -> KVHandle:
        prompt = list(range(3, 3 + num_tokens))
        self.prefill.add_request(
            prompt, SamplingParams(max_tokens=4, **GREEDY), request_id=request_id
        )
        (out,) = self.prefill.step()
        self.want(out.kv_handle)
        return out.kv_handle


def _in_memory(prefill, sender) -> Iterator[tuple[KVReceiver, Callable, Callable]]:
    yield InMemoryKVReceiver(sender), lambda handle: None, sender.close


def _grpc(prefill, sender) -> Iterator[tuple[KVReceiver, Callable, Callable]]:
    block_bytes = prefill.kv_cache.spec.bytes_per_block
    servicer = KVTransferServicer(
        sender, lambda fn: fn(), prefill.kv_peer_info, chunk_bytes=3 * block_bytes
    )
    service = start_service(
        "prefill",
        [(add_kv_transfer_servicer, servicer, "pdserve.v1.KVTransfer")],
        "127.0.0.1",
        0,
        0,
    )
    receiver = GrpcKVReceiver(timeout_s=5)
    try:
        yield (
            receiver,
            lambda h: receiver.set_source(h.request_id, service.grpc_address),
            lambda: service.server.stop(0).wait(),
        )
    finally:
        receiver.close()
        service.server.stop(0)


BACKENDS = {"in_memory": _in_memory, "grpc": _grpc}


def test_every_registered_receiver_runs_the_contract():
    assert set(RECEIVERS) == set(BACKENDS)


@pytest.fixture(params=sorted(BACKENDS))
def backend(request, tiny_llama) -> Iterator[Backend]:
    clock = FakeClock()
    sender = KVSender(LEASE_S, clock)
    prefill = make_engine(
        tiny_llama, role=EngineRole.PREFILL, num_blocks=128, block_size=4, kv_sender=sender
    )
    ends = BACKENDS[request.param](prefill, sender)
    receiver, want, kill = next(ends)
    yield Backend(prefill, sender, receiver, clock, want, kill)
    ends.close()


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
