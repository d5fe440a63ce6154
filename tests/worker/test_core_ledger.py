"""The core ledger: one holder per CPU at a time, lend / borrow / reclaim / give back, across
processes."""

from __future__ import annotations

import multiprocessing
import random

import pytest

from services.worker.core_ledger import CoreLedger


@pytest.fixture
def ledger_path(tmp_path):
    path = tmp_path / "cores"
    CoreLedger.create(path, {"prefill-0": [0, 1], "decode-0": [2, 3]}).close()
    return path


def test_each_worker_starts_holding_its_own(ledger_path):
    prefill = CoreLedger.open(ledger_path, "prefill-0")
    assert prefill.home() == prefill.held() == [0, 1]
    assert prefill.holders() == {0: "prefill-0", 1: "prefill-0", 2: "decode-0", 3: "decode-0"}
    assert prefill.borrow() == []  # nothing is free
    with pytest.raises(ValueError, match="core_ledger: 'router' is not one of"):
        CoreLedger.open(ledger_path, "router")
    with pytest.raises(ValueError, match="home_cpus: a CPU has two owners"):
        CoreLedger.create(ledger_path.with_name("x"), {"a": [0], "b": [0]})


def test_lend_borrow_reclaim_give_back(ledger_path):
    prefill = CoreLedger.open(ledger_path, "prefill-0")
    decode = CoreLedger.open(ledger_path, "decode-0")
    assert decode.lend() == [2, 3] and decode.held() == []  # idle: lends both
    assert prefill.borrow(limit=1) == [2] and prefill.held() == [0, 1, 2]
    assert not prefill.reclaimed()
    assert decode.reclaim() == [2]  # 3 was free: back at once; 2 is out
    assert decode.held() == [3] and prefill.borrow() == []  # 2 is wanted back: not lendable
    assert prefill.reclaimed()
    assert prefill.give_back() == [2]  # after its step
    assert decode.reclaim() == [] and decode.held() == [2, 3] and prefill.held() == [0, 1]
    decode.lend()
    assert prefill.borrow() == [2, 3]
    assert prefill.give_back(everything=True) == [2, 3]  # done: free again, not the owner's
    assert prefill.holders()[2] is None and decode.reclaim() == [] and decode.held() == [2, 3]


def _churn(path: str, worker: str, seed: int, rounds: int, start, out) -> None:
    """Random lends, borrows, reclaims and give-backs; after each, the CPUs this worker holds
    are recorded with the generation it saw, for the parent to check exclusivity."""
    ledger = CoreLedger.open(path, worker)
    rng = random.Random(seed)
    held = []
    start.wait(timeout=60)  # both churn at once
    for _ in range(rounds):
        action = rng.choice(["lend", "borrow", "reclaim", "give_back", "give_all"])
        if action == "lend":
            ledger.lend()
        elif action == "borrow":
            ledger.borrow(rng.randint(0, 2))
        elif action == "reclaim":
            ledger.reclaim()
        else:
            ledger.give_back(everything=action == "give_all")
        with ledger._locked() as r:  # what it holds, and each CPU's generation, at one moment
            held.append([(int(c), int(g)) for c, h, g in r[:, [0, 2, 4]] if h == ledger.me])
    out.put((worker, held))


def test_no_cpu_has_two_holders_across_processes(ledger_path):
    """Two processes churn the ledger at once; at any generation of a CPU at most one of them
    held it (each (cpu, generation) pair is seen by one worker only)."""
    context = multiprocessing.get_context("spawn")
    out, start = context.Queue(), context.Barrier(2)
    procs = [
        context.Process(target=_churn, args=(str(ledger_path), w, seed, 3000, start, out))
        for seed, w in enumerate(["prefill-0", "decode-0"])
    ]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    seen = {w: {pair for step in held for pair in step} for w, held in results.items()}
    assert seen["prefill-0"] and seen["decode-0"]
    assert not seen["prefill-0"] & seen["decode-0"]
    assert {c for c, _ in seen["prefill-0"]} & {2, 3}  # each borrowed the other's CPUs
    assert {c for c, _ in seen["decode-0"]} & {0, 1}
