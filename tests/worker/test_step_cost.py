"""A decode worker's cost model: the saved one, else a quick profile once (saved for the next
worker), or none when asked or when the KV cache is too small to profile."""

from __future__ import annotations

import pytest

from services.cost_model import profile, store
from services.engine.step_budget import StepBudget
from services.worker.step_cost import settle_step_cost
from tests.engine.helpers import make_engine

SMALL = profile.Grid(
    prefill=((8, 0), (32, 0), (16, 64)),
    decode=((1, 16), (4, 64), (8, 32)),
    mixed=((2, 32, 16, 0), (2, 32, 8, 32)),
    repeats=1,
)


@pytest.fixture
def saved_here(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(profile, "QUICK", SMALL)
    return tmp_path / "cost_models"


def test_auto_profiles_once_and_the_next_worker_loads_it(tiny_llama, saved_here, monkeypatch):
    engine = make_engine(tiny_llama, num_blocks=128, poison=False)
    cost = settle_step_cost(engine, 1, "auto")
    assert cost is not None and cost.threads == 1
    assert engine.scheduler.step_budget == StepBudget(cost)
    assert [p.suffix for p in saved_here.iterdir()].count(".json") == 1

    def no_profile(*args, **kwargs):
        raise AssertionError("profiled again")

    monkeypatch.setattr(profile, "profile", no_profile)
    again = make_engine(tiny_llama, num_blocks=128, poison=False)
    assert settle_step_cost(again, 1, "auto") == cost  # loaded, not fitted
    assert settle_step_cost(again, 2, "saved") is None  # no model for 2 threads
    assert again.scheduler.step_budget is None


def test_off_and_too_small_a_cache_leave_steps_capped_only(tiny_llama, saved_here, caplog):
    engine = make_engine(tiny_llama, num_blocks=128, poison=False)
    assert settle_step_cost(engine, 1, "off") is None and engine.scheduler.step_budget is None
    assert not saved_here.exists()
    small = make_engine(tiny_llama, num_blocks=10, poison=False)  # not the whole quick sweep
    assert settle_step_cost(small, 1, "auto") is None
    assert small.scheduler.step_budget is None
    assert "no quick profile: its largest step needs 16 KV blocks, this worker has 10" in (
        caplog.text
    )
    assert not list(saved_here.glob("*.json"))  # nothing fitted, nothing saved
