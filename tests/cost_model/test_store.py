"""Fitted step costs on disk: keyed by machine, dtype and model; thread counts merged."""

from __future__ import annotations

import json

import pytest

from services.cost_model.step_cost import StepCost
from services.cost_model.store import CostModelKey, load, machine_id, save

KEY = CostModelKey(device="cpu-a|0123", dtype="float32", model="smollm2-135m-instruct")


def test_saved_costs_load_back_and_thread_counts_merge(tmp_path):
    one = StepCost(1, (1e-3, 2e-4, 1e-8, 1e-7, 5e-5, 2e-3, 3e-6))
    two = StepCost(2, (9e-4, 1e-4, 6e-9, 8e-8, 4e-5, 1e-3, 2e-6))
    assert load(KEY, tmp_path) == []
    save(KEY, [one], tmp_path)
    path = save(KEY, [two], tmp_path)
    assert load(KEY, tmp_path) == [one, two]
    assert json.loads(path.read_text())["key"]["model"] == "smollm2-135m-instruct"
    other = CostModelKey(device=KEY.device, dtype="bfloat16", model=KEY.model)
    assert other.path(tmp_path) != KEY.path(tmp_path) and load(other, tmp_path) == []


def test_a_file_of_another_key_or_feature_set_names_the_field(tmp_path):
    path = save(KEY, [StepCost(1, (1.0,) * 7)], tmp_path)
    body = json.loads(path.read_text())
    path.write_text(json.dumps({**body, "features": ["fixed", "tokens"]}))
    with pytest.raises(ValueError, match="^cost_model:"):
        load(KEY, tmp_path)
    path.write_text(json.dumps({**body, "key": {**body["key"], "dtype": "bfloat16"}}))
    with pytest.raises(ValueError, match="^cost_model:"):
        load(KEY, tmp_path)


def test_the_machine_id_names_the_cpu_and_is_stable():
    assert machine_id() == machine_id() and "|" in machine_id()


def test_a_corrupt_file_names_itself_and_a_new_fit_replaces_it(tmp_path):
    path = KEY.path(tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"format": 2, broken')
    with pytest.raises(
        ValueError, match=r"^cost_model: .* is not JSON .*`pdserve profile` rewrites"
    ):
        load(KEY, tmp_path)
    fresh = StepCost(1, (1.0,) * 7)
    save(KEY, [fresh], tmp_path)
    assert load(KEY, tmp_path) == [fresh]
