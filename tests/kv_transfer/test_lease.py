"""Source-side leases: every transition, late and duplicate messages, and a random-operations
property test that no pinned block is ever leaked or freed twice."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.engine import EngineRole, SamplingParams
from services.engine.errors import RequestNotFoundError
from services.kv_transfer.in_memory import InMemoryKVTransfer
from services.kv_transfer.lease import LeaseTable, TransferStatus
from tests.engine.helpers import GREEDY, make_engine


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lease_lapses_only_unrenewed_and_never_while_pulling():
    clock = FakeClock()
    table = LeaseTable(lease_s=2.0, clock=clock)
    assert table.publish("a") and table.publish("b") and table.publish("c")
    clock.now += 1.5
    assert table.renew("a")  # a: runs to 103.5 now
    table.begin_pull("b")  # b: a pull in progress cannot lapse
    clock.now += 1.0
    assert table.expire_due() == ["c"]
    assert table.status("c") == TransferStatus.EXPIRED
    assert table.status("b") == TransferStatus.PULLING
    clock.now += 5.0
    assert table.expire_due() == ["a"]  # b still pulling
    table.end_pull("b")  # b's lease runs again from the end of the pull
    clock.now += 1.9
    assert table.expire_due() == []
    clock.now += 0.2
    assert table.expire_due() == ["b"] and len(table) == 0


def test_late_and_duplicate_messages_are_harmless():
    clock = FakeClock()
    table = LeaseTable(lease_s=1.0, clock=clock)
    table.publish("done")
    assert table.complete("done") is True
    assert table.complete("done") is False  # duplicate completion
    assert table.renew("done") is False  # late renewal
    with pytest.raises(RequestNotFoundError, match="was completed"):
        table.begin_pull("done")  # late pull
    table.publish("lapsed")
    clock.now += 2
    assert table.expire_due() == ["lapsed"]
    assert table.complete("lapsed") is False and table.status("lapsed") == TransferStatus.EXPIRED
    table.publish("aborted")
    assert table.revoke("aborted") is True and table.revoke("aborted") is False
    assert table.complete("aborted") is False and table.status("aborted") == TransferStatus.REVOKED
    # A completion that overtook its publish (the client cancelled mid-prefill) ends it at publish.
    assert table.complete("early") is False
    assert table.publish("early") is False and table.status("early") == TransferStatus.COMPLETED
    with pytest.raises(ValueError, match="kv_lease_seconds"):
        LeaseTable(lease_s=0)


def test_engine_frees_a_lapsed_pin_and_ignores_its_late_completion(tiny_llama):
    clock = FakeClock()
    transfer = InMemoryKVTransfer(lease_s=5.0)
    transfer.sender.leases.clock = clock
    prefill = make_engine(tiny_llama, role=EngineRole.PREFILL, num_blocks=32, kv_transfer=transfer)
    handle = _prefill(prefill, "a", 40)
    assert prefill.num_pinned_blocks == 3
    clock.now += 4
    assert transfer.sender.renew("a") and transfer.sender.expire_leases() == []
    clock.now += 6
    assert transfer.sender.expire_leases() == ["a"]
    assert prefill.num_pinned_blocks == 0 and prefill.kv_cache.pool.num_used_blocks == 0
    transfer.receiver.complete(
        handle
    )  # the decode worker's completion arrives late: nothing happens
    with pytest.raises(RequestNotFoundError):
        transfer.receiver.pull(handle)
    prefill.check_integrity()


def _prefill(engine, request_id: str, num_tokens: int):
    engine.add_request(
        list(range(3, 3 + num_tokens)),
        SamplingParams(max_tokens=4, **GREEDY),
        request_id=request_id,
    )
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                return out.kv_handle
    raise AssertionError("prefill did not finish")


OPS = st.lists(
    st.tuples(
        st.sampled_from(["prefill", "pull", "renew", "complete", "abort", "tick", "expire"]),
        st.integers(0, 7),
    ),
    max_size=40,
)


_EXAMPLES = itertools.count()


# One engine serves every example (loading one per example is slow); each example uses fresh
# request ids and ends with every lease expired, so none sees another's state.
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=OPS)
def test_random_transfer_messages_never_leak_or_double_free(tiny_llama_engine_pair, ops):
    """Any order of prefills, pulls, renewals, (late, duplicate) completions, aborts, clock ticks
    and expiries keeps exactly the live leases pinned; the last lease ending frees every block."""
    prefill, transfer, clock = tiny_llama_engine_pair
    handles = {}
    example = next(_EXAMPLES)
    for op, n in ops:
        rid = f"x{example}-r{n}"
        if op == "prefill" and rid not in handles and rid not in prefill.pinned:
            handles[rid] = _prefill(prefill, rid, 5 + 7 * n)
        elif op == "pull" and rid in handles:
            try:
                (data,) = transfer.receiver.pull(handles[rid])
                assert data.shape[2] == len(handles[rid].block_ids)
            except RequestNotFoundError:
                assert rid not in prefill.pinned
        elif op == "renew":
            assert transfer.sender.renew(rid) == (rid in prefill.pinned)
        elif op == "complete" and rid in handles:
            transfer.receiver.complete(handles[rid])
        elif op == "abort" and rid in prefill.pinned:
            prefill.abort(rid)
        elif op == "tick":
            clock.now += n
        elif op == "expire":
            transfer.sender.expire_leases()
        live = {
            r
            for r in handles
            if transfer.sender.status(r) in (TransferStatus.PUBLISHED, TransferStatus.PULLING)
        }
        assert live == set(prefill.pinned)
        prefill.check_integrity()
    clock.now += 1000
    transfer.sender.expire_leases()
    assert not prefill.pinned and prefill.kv_cache.pool.num_used_blocks == 0
    prefill.check_integrity()


@pytest.fixture
def tiny_llama_engine_pair(tiny_llama):
    """A PREFILL engine on an in-memory transfer with a 6 s lease on a fake clock (reset for
    every hypothesis example by the final expiry)."""
    clock = FakeClock()
    transfer = InMemoryKVTransfer(lease_s=6.0)
    transfer.sender.leases.clock = clock
    engine = make_engine(
        tiny_llama,
        role=EngineRole.PREFILL,
        num_blocks=64,
        kv_transfer=transfer,
        enable_prefix_caching=False,
    )
    return engine, transfer, clock


def test_an_end_during_a_pull_waits_for_the_pull(tiny_llama):
    """Pulls read pinned blocks in place, so a completion or an abort that comes during one frees
    the blocks only when the last pull ends; no new pull starts meanwhile."""
    clock = FakeClock()
    table = LeaseTable(lease_s=1.0, clock=clock)
    table.publish("a")
    table.begin_pull("a")
    table.begin_pull("a")
    assert table.complete("a") is False and table.complete("a") is False  # held, once
    assert table.renew("a") is False
    with pytest.raises(RequestNotFoundError, match="completed"):
        table.begin_pull("a")
    assert table.end_pull("a") is False  # one pull still reads
    assert table.end_pull("a") is True and table.status("a") == TransferStatus.COMPLETED
    assert table.end_pull("a") is False

    transfer = InMemoryKVTransfer()
    prefill = make_engine(tiny_llama, role=EngineRole.PREFILL, num_blocks=32, kv_transfer=transfer)
    _prefill(prefill, "b", 40)
    transfer.sender.leases.begin_pull("b")
    prefill.abort("b")  # the client went away while a decode worker reads the blocks
    assert prefill.num_pinned_blocks == 3 and transfer.sender.status("b") == TransferStatus.PULLING
    transfer.sender.end_pull("b")
    assert prefill.num_pinned_blocks == 0 and transfer.sender.status("b") == TransferStatus.REVOKED
    assert prefill.kv_cache.pool.num_used_blocks == 0
    prefill.check_integrity()
