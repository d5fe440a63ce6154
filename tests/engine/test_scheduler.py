"""Scheduling: one token per running request per decode step, chunking, preemption by recompute."""

from __future__ import annotations

import time

import pytest

from services.engine import LLM, SamplingParams
from tests.engine.helpers import GREEDY, make_engine, run_to_completion


def test_decode_step_feeds_exactly_one_new_token_per_running_request(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=256)
    seen: list[int] = []  # input_ids length of every forward
    forward = engine.model.forward
    engine.model.forward = lambda input_ids, *a, **k: (
        seen.append(int(input_ids.shape[0])),
        forward(input_ids, *a, **k),
    )[1]
    for i, n in enumerate([5, 9, 30]):
        engine.add_request(
            list(range(2, 2 + n)), SamplingParams(max_tokens=6, **GREEDY), request_id=f"r{i}"
        )
    engine.step()
    assert seen == [5 + 9 + 30]
    for _ in range(5):
        engine.step()
        running = len(engine.last_step.scheduled)
        assert running == 3
        assert [len(s.token_ids) for s in engine.last_step.scheduled] == [1, 1, 1]
        assert seen[-1] == running  # the forward itself saw exactly one token per request
    assert not engine.has_unfinished_requests()


def test_chunked_prefill_packs_prompts_under_the_token_budget(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=256, max_num_batched_tokens=24)
    requests = {
        f"r{i}": (list(range(2, 2 + n)), SamplingParams(max_tokens=4, **GREEDY))
        for i, n in enumerate([40, 10, 3])
    }
    outs, steps = run_to_completion(engine, requests)
    assert all(sum(step.values()) <= 24 for step in steps)
    assert steps[0] == {"r0": 24}
    assert steps[1] == {"r0": 16, "r1": 8}
    reference, _ = run_to_completion(make_engine(tiny_llama, num_blocks=256), requests)
    assert outs == reference


def test_preemption_by_recompute_keeps_greedy_output(tiny_llama):
    """A pool too small for all requests at once forces preemption; outputs do not change."""
    requests = {
        f"r{i}": (list(range(3 + i, 3 + i + 20 + 3 * i)), SamplingParams(max_tokens=40, **GREEDY))
        for i in range(8)
    }
    roomy, _ = run_to_completion(make_engine(tiny_llama, block_size=4, num_blocks=1024), requests)
    tight_engine = make_engine(tiny_llama, block_size=4, num_blocks=48)
    tight, _ = run_to_completion(tight_engine, requests)
    assert tight_engine.scheduler.num_preemptions > 0
    assert tight == roomy


def test_seeded_sampling_survives_preemption(tiny_llama):
    params = SamplingParams(max_tokens=40, temperature=1.0, top_k=50, seed=11)
    requests = {f"r{i}": (list(range(3 + i, 30 + i)), params) for i in range(6)}
    roomy, _ = run_to_completion(make_engine(tiny_llama, block_size=4, num_blocks=1024), requests)
    tight_engine = make_engine(tiny_llama, block_size=4, num_blocks=30)
    tight, _ = run_to_completion(tight_engine, requests)
    assert tight_engine.scheduler.num_preemptions > 0
    assert tight == roomy


def test_max_num_seqs_limits_the_batch(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=256, max_num_seqs=2)
    requests = {f"r{i}": ([2, 3, 4 + i], SamplingParams(max_tokens=3, **GREEDY)) for i in range(5)}
    outs, steps = run_to_completion(engine, requests)
    assert max(len(step) for step in steps) == 2
    assert len(outs) == 5


def test_abort_running_and_waiting_requests_frees_blocks(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=64, max_num_seqs=1)
    engine.add_request(
        list(range(2, 40)), SamplingParams(max_tokens=50, **GREEDY), request_id="run"
    )
    engine.add_request([5, 6], SamplingParams(max_tokens=5, **GREEDY), request_id="wait")
    engine.step()
    assert engine.kv_cache.pool.num_used_blocks == 3
    engine.abort("run")
    engine.abort("wait")
    engine.check_integrity()
    assert engine.kv_cache.pool.num_free_blocks == 64
    assert not engine.has_unfinished_requests()
    with pytest.raises(KeyError):
        engine.abort("run")


def test_eos_and_stop_token_ids_finish_with_stop(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=64)
    (free_run,) = LLM(engine).generate([[7, 8, 9]], SamplingParams(max_tokens=10, **GREEDY))
    stop_at = free_run.token_ids[3]
    first = free_run.token_ids.index(stop_at)
    (stopped,) = LLM(engine).generate(
        [[7, 8, 9]],
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=(stop_at,)),
    )
    assert stopped.finish_reason == "stop" and stopped.token_ids == free_run.token_ids[: first + 1]
    engine.eos_token_id = stop_at
    (eos,) = LLM(engine).generate([[7, 8, 9]], SamplingParams(max_tokens=10, temperature=0))
    assert eos.finish_reason == "stop" and eos.token_ids[-1] == stop_at


def test_max_model_len_caps_generation(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=64, max_model_len=20)
    (out,) = LLM(engine).generate([list(range(2, 17))], SamplingParams(max_tokens=100, **GREEDY))
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_a_step_orders_prompt_chunks_by_length_after_fcfs_admission(tiny_llama):
    """Admission is first come, first served (all three fit the budget); inside the step the
    prompt chunks run longest first, so equal lengths sit side by side."""
    engine = make_engine(tiny_llama, num_blocks=256, max_num_batched_tokens=64)
    seen = []
    model = engine.runner.model
    engine.runner.model = lambda ids, pos, cache, meta, rows: (
        seen.append(meta),
        model(ids, pos, cache, meta, rows),
    )[1]
    requests = {
        f"r{i}": (list(range(2 + 50 * i, 2 + 50 * i + n)), SamplingParams(max_tokens=2, **GREEDY))
        for i, n in enumerate([5, 20, 12, 20])
    }
    outs, steps = run_to_completion(engine, requests)
    assert steps[0] == {"r0": 5, "r1": 20, "r2": 12, "r3": 20}
    assert [p.query_len for p in seen[0].prefills] == [20, 20, 12, 5]
    # Back to back in the batch, each group is a slice: views of q, k, v, no gather.
    assert list(seen[0].fresh_prefill_groups) == [
        (slice(0, 40), 2),
        (slice(40, 52), 1),
        (slice(52, 57), 1),
    ]
    reference, _ = run_to_completion(make_engine(tiny_llama, num_blocks=256), requests)
    assert outs == reference


def test_request_metrics_span_queue_and_every_prefill_chunk(tiny_llama):
    """`RequestOutput.metrics`: arrival -> first scheduled is the queue (r1 waits while r0's
    chunks fill the budget), first scheduled -> first token spans all of a chunked prompt's
    steps; absent until the first token, then fixed."""
    engine = make_engine(tiny_llama, num_blocks=256, max_num_batched_tokens=16, max_num_seqs=1)
    params = SamplingParams(max_tokens=3, **GREEDY)
    engine.add_request(list(range(2, 42)), params, request_id="r0")  # 3 chunks
    engine.add_request(list(range(2, 10)), params, request_id="r1")
    seen: dict[str, list] = {"r0": [], "r1": []}
    step_starts = []
    while engine.has_unfinished_requests():
        step_starts.append(time.monotonic())
        for out in engine.step():
            seen[out.request_id].append(out.metrics)
    first = {rid: metrics[0] for rid, metrics in seen.items()}
    assert all(m is not None for metrics in seen.values() for m in metrics)
    assert all(m == first[rid] for rid, metrics in seen.items() for m in metrics)
    r0, r1 = first["r0"], first["r1"]
    assert r0.first_scheduled_time <= step_starts[1] < step_starts[2] <= r0.first_token_time
    assert r1.first_scheduled_time >= r0.first_token_time  # max_num_seqs 1: it waited for r0
    assert r1.time_in_queue > r0.time_in_queue >= 0 and r0.time_to_first_token > 0
