"""Steps logged while serving: their shapes, the file format, the model's error on them."""

from __future__ import annotations

import pytest

from services.cost_model.step_cost import StepCost, StepShape
from services.cost_model.step_log import (
    StepLog,
    StepRecord,
    prediction_errors,
    read,
    shape_of,
)


def test_one_token_rows_are_decodes_and_longer_rows_chunks():
    assert shape_of([(16, 0), (1, 99), (5, 32), (1, 0)]) == StepShape(
        chunks=((16, 0), (5, 32)), decode_contexts=(100, 1)
    )


def test_records_round_trip_and_a_bad_line_names_the_step_log(tmp_path):
    path = tmp_path / "steps.jsonl"
    log = StepLog(path)
    records = [StepRecord(((16, 0),), 0.25, 2), StepRecord(((1, 7), (1, 9)), 0.031, 1)]
    for record in records:
        log.write(record)
    log.close()
    assert read(path) == records
    path.write_text('{"rows": [[1, 2]], "s": 0.1}\n')
    with pytest.raises(ValueError, match=r"^step_log: not a step record"):
        read(path)


def test_errors_per_thread_count_and_kind():
    cost = StepCost(2, (0.01, 0.001, 0.0, 0.0, 0.001, 0.0, 0.0))
    records = [
        StepRecord(((1, 9),), 0.011 * 1.1, 2),  # decode: 10% slower than predicted
        StepRecord(((10, 0),), 0.02, 2),  # prefill: exact
        StepRecord(((10, 0), (1, 4)), 0.021 * 0.8, 2),  # mixed: 20% faster
        StepRecord(((1, 9),), 1.0, 4),  # no model for 4 threads: left out
    ]
    (error,) = prediction_errors(records, [cost])
    assert error.threads == 2 and error.num_steps == 3
    assert error.median_pct == pytest.approx(100 / 11, rel=1e-6)
    assert error.by_kind["prefill"] == (1, pytest.approx(0.0, abs=1e-9))
    assert error.by_kind["mixed"][1] == pytest.approx(25.0)
    assert error.p90_pct == pytest.approx(25.0)
