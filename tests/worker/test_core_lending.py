"""Core lending's controller on one ledger, with fake engines and a fake team pin: an idle worker
lends, a busy one borrows and widens its team (own CPUs first), gives back between steps or
between two layers of a step when the owner's queue fills, and an owner takes back CPUs whose
borrower died."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from services.cost_model import store
from services.cost_model.step_cost import FEATURES, StepCost
from services.worker import core_lending
from services.worker.core_ledger import CoreLedger, worker_name
from services.worker.core_lending import CoreLending


class FakeEngine:
    def __init__(self) -> None:
        self.scheduler = SimpleNamespace(step_budget=None)
        self.costs_used: list[StepCost | None] = []

    def use_step_cost(self, cost: StepCost | None) -> None:
        self.costs_used.append(cost)


def make(path, name: str, costs=None) -> tuple[CoreLending, FakeEngine, list[list[int]]]:
    engine, pins = FakeEngine(), []

    def pin(cpus: list[int]) -> list[int]:
        pins.append(list(cpus))
        return []  # no team threads to wait for

    lending = CoreLending(CoreLedger.open(path, name), engine, name, pin, costs)
    return lending, engine, pins


@pytest.fixture
def ledger_path(tmp_path):
    path = tmp_path / "cores"
    CoreLedger.create(path, {"prefill-0": [0], "decode-0": [1, 2]}).close()
    return path


def test_an_idle_worker_lends_and_a_busy_one_borrows_then_gives_back_when_reclaimed(ledger_path):
    prefill, prefill_engine, prefill_pins = make(ledger_path, "prefill-0")
    decode, decode_engine, decode_pins = make(ledger_path, "decode-0")
    prefill.start()
    decode.start()
    assert prefill_pins == [[0]] and decode_pins == [[1, 2]]

    prefill.idle()  # nothing to compute: CPU 0 is free, its team one thread
    assert prefill.held == [] and decode.ledger.holders()[0] is None and prefill_pins[-1] == []
    decode.before_step()  # busy: takes it, own CPUs first (the engine thread stays on CPU 1)
    assert decode_pins[-1] == [1, 2, 0] and decode.held == [1, 2, 0]

    # The prefill worker's queue fills: it waits for the decode worker's step to end.
    returned = threading.Event()
    waiter = threading.Thread(target=lambda: (prefill.reclaim(), returned.set()))
    waiter.start()
    time.sleep(0.05)
    assert not returned.is_set()  # the borrower is mid-step: the owner waits
    decode.before_step()  # the borrower's next step boundary: gives CPU 0 back
    waiter.join(timeout=5)
    assert returned.is_set()
    prefill.before_step()
    assert prefill.held == [0] and prefill_pins[-1] == [0]
    assert decode.held == [1, 2] and decode_pins[-1] == [1, 2]
    assert prefill.ledger.holders() == {0: "prefill-0", 1: "decode-0", 2: "decode-0"}


def test_a_borrower_gives_back_between_two_layers_of_its_step(ledger_path):
    """An owner whose work comes back waits one layer, not the borrower's whole step: between two
    layers the borrower shrinks its team to its own CPUs and releases the reclaimed one; with no
    owner asking, the check changes nothing."""
    prefill, _, prefill_pins = make(ledger_path, "prefill-0")
    decode, _, decode_pins = make(ledger_path, "decode-0")
    prefill.start()
    decode.start()
    prefill.idle()
    decode.before_step()
    assert decode.held == [1, 2, 0]
    pins = len(decode_pins)
    decode.between_layers()  # nobody asks: nothing moves
    assert len(decode_pins) == pins and decode.held == [1, 2, 0]

    returned = threading.Event()
    waiter = threading.Thread(target=lambda: (prefill.reclaim(), returned.set()))
    waiter.start()
    deadline = time.monotonic() + 5
    while not decode.ledger.reclaim_asked() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not returned.is_set()  # mid-layer: the owner waits
    decode.between_layers()  # the next layer boundary of the same step
    waiter.join(timeout=5)
    assert returned.is_set()
    assert decode.held == [1, 2] and decode_pins[-1] == [1, 2]
    prefill.before_step()
    assert prefill.held == [0] and prefill_pins[-1] == [0]
    decode.between_layers()  # its own CPUs only: nothing to give back
    assert decode_pins[-1] == [1, 2] and len(decode_pins) == pins + 1


def test_a_lender_that_is_lent_already_does_nothing_more(ledger_path):
    prefill, _, pins = make(ledger_path, "prefill-0")
    prefill.start()
    prefill.idle()
    generation = prefill.ledger._records[:, 4].copy()
    prefill.idle()  # the idle loop calls it every poll: no ledger change
    assert (prefill.ledger._records[:, 4] == generation).all() and pins == [[0], []]
    prefill.reclaim()
    prefill.before_step()
    assert prefill.held == [0]


def test_the_step_cost_follows_the_team_size(ledger_path):
    one, three = (StepCost(n, (0.01,) * len(FEATURES)) for n in (1, 3))
    prefill, _, _ = make(ledger_path, "prefill-0")
    decode, engine, _ = make(ledger_path, "decode-0", costs={2: "two", 3: three, 1: one})
    prefill.start()
    decode.start()
    assert engine.costs_used == ["two"]
    prefill.idle()
    decode.before_step()
    assert engine.costs_used[-1] is three
    decode.idle()
    prefill.reclaim()
    decode.reclaim()
    decode.before_step()
    assert engine.costs_used[-1] == "two"
    decode.costs = {2: "two"}  # no fit for three threads: the two-thread one, never none
    prefill.idle()
    decode.before_step()
    assert engine.costs_used[-1] == "two"


def test_an_owner_takes_back_cpus_whose_borrower_died(ledger_path, monkeypatch):
    monkeypatch.setattr(core_lending, "RECLAIM_TIMEOUT_S", 0.2)
    prefill, _, _ = make(ledger_path, "prefill-0")
    prefill.start()
    prefill.idle()
    borrow = (
        "from services.worker.core_ledger import CoreLedger;"
        f"print(CoreLedger.open({str(ledger_path)!r}, 'decode-0').borrow())"
    )
    out = subprocess.run([sys.executable, "-c", borrow], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[0]"  # a process borrowed CPU 0, then exited holding it
    started = time.monotonic()
    prefill.reclaim()
    assert prefill.ledger.held() == [0] and time.monotonic() - started < 5


def test_a_restarted_worker_frees_what_its_earlier_process_borrowed(ledger_path):
    prefill, _, _ = make(ledger_path, "prefill-0")
    prefill.start()
    prefill.idle()
    CoreLedger.open(ledger_path, "decode-0").borrow()  # the earlier decode process
    decode, _, pins = make(ledger_path, "decode-0")
    decode.start()  # the new one
    assert pins == [[1, 2]] and decode.ledger.holders()[0] is None


def test_worker_name_drops_the_per_process_suffix():
    assert worker_name("decode-0-0123456789ab") == "decode-0"
    assert worker_name("prefill-12-abcdefabcdef") == "prefill-12"
    assert worker_name("my-engine") == "my-engine"
    assert worker_name("decode-0-notahexsuffix") == "decode-0-notahexsuffix"


def test_open_lending_brings_the_saved_fits_to_a_prefill_worker_not_to_a_decode_worker_off(
    ledger_path, tmp_path, monkeypatch
):
    """A prefill worker sizes no mixed steps, so no cost model was settled for it; core lending
    still brings it the saved fits, so its steps on borrowed CPUs keep within BORROWED_STEP_S.
    A decode worker whose --cost-model is off (no step budget) gets none."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    key = store.CostModelKey("cpu|test", "float32", "tiny")
    fits = [StepCost(n, tuple(0.001 * (i + 1) / n for i in range(len(FEATURES)))) for n in (1, 2)]
    store.save(key, fits)

    hooks: dict = {}

    def engine(engine_id: str) -> SimpleNamespace:
        config = SimpleNamespace(engine_id=engine_id)
        fake = FakeEngine()
        return SimpleNamespace(
            config=config, scheduler=fake.scheduler, cost_model_key=lambda: key,
            use_step_cost=fake.use_step_cost,
            between_layers=lambda hook: hooks.__setitem__(engine_id, hook),
        )  # fmt: skip

    prefill = core_lending.open_lending(str(ledger_path), engine("prefill-0"), "prefill")
    decode_off = core_lending.open_lending(str(ledger_path), engine("decode-0"), "decode")
    try:
        assert prefill.costs == {1: fits[0], 2: fits[1]}
        assert decode_off.costs == {}
        # each engine gives borrowed CPUs back between its layers
        assert hooks == {"prefill-0": prefill.between_layers, "decode-0": decode_off.between_layers}
    finally:
        prefill.ledger.close()
        decode_off.ledger.close()
