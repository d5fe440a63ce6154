"""The lease table and the registrar (services/common/member_leases.py), on a hand-driven clock
and a recording transport."""

from __future__ import annotations

import threading
import time

import pytest

from services.common.member_leases import Member, MemberTable, Registrar

A = Member("prefill", "127.0.0.1:5001", "http://127.0.0.1:6001/metrics", "replica-a")
B = Member("decode", "127.0.0.1:5002")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _table(ttl: float = 3.0):
    clock, events = Clock(), []
    table = MemberTable(
        ttl,
        on_join=lambda m: events.append(("join", m.address)),
        on_leave=lambda m: events.append(("leave", m.address)),
        clock=clock,
    )
    return table, clock, events


def test_members_join_once_renew_and_lapse_after_their_ttl():
    table, clock, events = _table(ttl=3.0)
    assert table.register(A) is True and table.register(B) is True
    assert table.register(A) is False  # a renewal
    assert events == [("join", A.address), ("join", B.address)]
    clock.now += 2.0
    table.register(A)  # renewed at 102: lapses at 105; B lapses at 103
    clock.now += 1.0
    assert table.expire() == [B]
    assert table.members() == [A] and table.members("decode") == []
    clock.now += 1.9
    assert table.expire() == []
    clock.now += 0.1
    assert table.expire() == [A] and table.members() == []
    assert events[2:] == [("leave", B.address), ("leave", A.address)]


def test_leave_removes_at_once_and_a_changed_member_replaces_its_entry():
    table, _, events = _table()
    table.register(A)
    moved = Member("decode", A.address)  # the same address, now a decode worker
    assert table.register(moved) is True
    assert events == [("join", A.address), ("leave", A.address), ("join", A.address)]
    assert table.members() == [moved]
    assert table.leave(A.address) == moved and table.leave(A.address) is None
    assert table.members() == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"role": "both", "address": "127.0.0.1:1"}, "role"),
        ({"role": "decode", "address": "127.0.0.1"}, "address"),
        ({"role": "decode", "address": ":80"}, "address"),
    ],
)
def test_a_bad_member_names_its_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        Member(**kwargs)


def test_a_table_needs_a_positive_ttl():
    with pytest.raises(ValueError, match="^ttl:"):
        MemberTable(0)


def test_the_registrar_registers_renews_survives_failures_and_leaves():
    calls, fail = [], threading.Event()

    def register(member: Member, leave: bool) -> float:
        calls.append((member.address, leave))
        if fail.is_set():
            raise ConnectionError("router down")
        return 0.15  # renew every 0.05 s

    registrar = Registrar(A, register)
    registrar.start()
    time.sleep(0.3)
    renewals = len(calls)
    assert renewals >= 4 and all(not leave for _, leave in calls)
    fail.set()
    time.sleep(0.2)
    fail.clear()
    time.sleep(0.2)
    assert len(calls) > renewals + 4  # it kept trying through the outage
    registrar.stop()
    assert calls[-1] == (A.address, True)
    count = len(calls)
    time.sleep(0.15)
    assert len(calls) == count  # stopped renewing


def test_a_first_registration_that_fails_is_raised():
    def register(member: Member, leave: bool) -> float:
        raise ConnectionError("no router at 127.0.0.1:1")

    with pytest.raises(ConnectionError, match="no router"):
        Registrar(B, register).start()


def test_a_followed_source_is_the_authority_for_what_it_listed():
    """A member the source stops listing leaves the router's pool at once (under Ray: the
    registry expired or dropped it), not a router ttl later; one registered directly stays."""
    from services.router.pool.registration import RouterMembership
    from services.router.pool.worker_pool import WorkerPool

    pool = WorkerPool([], [], dynamic=True)
    membership = RouterMembership(pool, ttl_s=60.0)
    listed = [A, B]
    membership.register(Member("decode", "127.0.0.1:5003"))  # via RegisterWorker
    membership.follow(lambda: list(listed), interval_s=0.02)
    try:
        deadline = time.monotonic() + 5
        while pool.decode != ["127.0.0.1:5003", B.address] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.prefill == [A.address] and pool.decode == ["127.0.0.1:5003", B.address]
        listed.remove(B)
        while B.address in pool.decode and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.decode == ["127.0.0.1:5003"] and pool.prefill == [A.address]
    finally:
        membership.close()
        pool.close()
