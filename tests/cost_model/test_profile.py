"""`pdserve profile`: hand-built steps of known shapes timed on an engine, one fit per thread
count, saved and checked against a step log (a tiny random-weight model: fast, not a figure)."""

from __future__ import annotations

import json

import pytest
import torch

from services.cli.main import main
from services.cost_model import profile, store
from services.cost_model.step_cost import StepShape
from services.cost_model.step_log import StepLog, StepRecord
from tests.engine.helpers import make_engine

SMALL = profile.Grid(
    prefill=((8, 0), (32, 0), (16, 64)),
    decode=((1, 16), (4, 64), (8, 32)),
    mixed=((2, 32, 16, 0), (2, 32, 8, 32)),
    repeats=1,
)


def test_the_sweep_times_each_shape_and_fits_every_thread_count(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=128, poison=False)
    free, before = engine.kv_cache.pool.num_free_blocks, torch.get_num_threads()
    results = profile.profile(engine, (1, 2), SMALL)
    assert [r.cost.threads for r in results] == [1, 2]
    for result in results:
        assert [p.shape for p in result.probes] == SMALL.shapes(engine.scheduler.max_model_len)
        assert all(p.seconds > 0 for p in result.probes)
        assert len(result.errors()) == len(SMALL.shapes(10_000)) == 8
    assert torch.get_num_threads() == before  # left as found
    assert engine.kv_cache.pool.num_free_blocks == free  # every borrowed block back


def test_shapes_longer_than_the_model_are_left_out():
    assert SMALL.shapes(40) == [
        StepShape(chunks=((8, 0),)),
        StepShape(chunks=((32, 0),)),
        StepShape(decode_contexts=(16,)),
        StepShape(decode_contexts=(32,) * 8),
        StepShape(chunks=((16, 0),), decode_contexts=(32, 32)),
        StepShape(chunks=((8, 32),), decode_contexts=(32, 32)),  # the chunk ends at 40
    ]
    assert StepShape(chunks=((8, 32),), decode_contexts=(32, 32)) not in SMALL.shapes(39)


def test_thread_counts_are_checked_against_the_cpus():
    assert profile.check_threads([2, 1, 2], 4) == (1, 2)
    for bad in ([], [0], [5]):
        with pytest.raises(ValueError, match=r"^--threads: .*\[1, 4\]"):
            profile.check_threads(bad, 4)


def test_the_command_saves_the_model_and_checks_it_on_a_step_log(
    tiny_llama, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(store, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(profile, "QUICK", SMALL)
    out = tmp_path / "profile.json"
    assert (
        main(["profile", "--model", tiny_llama, "--quick", "--threads", "1", "--json", str(out)])
        == 0
    )
    printed = capsys.readouterr().out
    assert "1 thread(s): 8 shapes, fit |error| median" in printed and "saved: " in printed
    body = json.loads(out.read_text())
    saved = tmp_path / "cost_models" / body["saved"].rpartition("/")[2]
    assert saved.exists() and [t["threads"] for t in body["threads"]] == [1]
    log = StepLog(tmp_path / "steps.jsonl")
    for rows in (((1, 40),), ((24, 0),), ((24, 0), (1, 30))):
        log.write(StepRecord(rows, 0.01, 1))
    log.write(StepRecord(((1, 40),), 0.01, 3))  # no model fitted at 3 threads
    log.close()
    assert main(["profile", "--model", tiny_llama, "--check", str(tmp_path / "steps.jsonl")]) == 0
    assert "1 thread(s): 3 steps, |error| median" in capsys.readouterr().out
    assert main(["profile", "--model", tiny_llama, "--threads", "0"]) == 2
    assert "--threads: each thread count must be in [1," in capsys.readouterr().err


def test_check_fails_fast_and_names_the_flag(tiny_llama, tmp_path, monkeypatch, capsys):
    """A missing, empty or malformed step log is refused before the model loads; a dtype with no
    saved model says so."""
    monkeypatch.setattr(store, "cache_dir", lambda: tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json {\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    for path, message in (
        (tmp_path / "missing.jsonl", "--check: cannot read"),
        (empty, "holds no step"),
        (bad, "--check: step_log: not a step record"),
    ):
        assert main(["profile", "--model", tiny_llama, "--check", str(path)]) == 2
        assert message in capsys.readouterr().err
    log = StepLog(tmp_path / "steps.jsonl")
    log.write(StepRecord(((1, 40),), 0.01, 1))
    log.close()
    args = ["profile", "--model", tiny_llama, "--check", str(tmp_path / "steps.jsonl")]
    assert main([*args, "--dtype", "bfloat16"]) == 2
    assert "--check: no saved model for bfloat16" in capsys.readouterr().err
