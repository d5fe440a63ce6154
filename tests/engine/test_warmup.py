"""Engine.warm_up: one dummy prefill and one dummy decode forward that leave no trace, in every
role: blocks, their order and bytes, prefix cache, KV events, counters, seeds, later outputs."""

from __future__ import annotations

import pytest
import torch

from services.engine import EngineRole, SamplingParams
from services.engine.errors import ResourceExhaustedError
from services.kv_transfer.in_memory import InMemoryKVTransfer
from tests.engine.helpers import GREEDY, make_engine, run_to_completion

ROLES = [EngineRole.BOTH, EngineRole.PREFILL, EngineRole.DECODE]


def _state(engine) -> dict:
    """Everything a warm-up must leave as it found it (the KV bytes are compared apart)."""
    pool, scheduler = engine.kv_cache.pool, engine.scheduler
    return {
        "free": pool.num_free_blocks,
        "cached": pool.num_cached_blocks,
        "hashes": engine.prefix_cache_hashes(),
        "events": engine.take_kv_events(),
        "requests": dict(engine.requests),
        "pinned": engine.num_pinned_blocks,
        "waiting": engine.num_waiting,
        "running": scheduler.num_running,
        "prompt_tokens_computed": scheduler.num_prompt_tokens_computed,
        "prefix_queries": (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits),
        "preemptions": scheduler.num_preemptions,
        "last_forward_tokens": dict(engine.last_forward_tokens),
        "has_work": engine.has_unfinished_requests(),
    }


@pytest.mark.parametrize("role", ROLES, ids=lambda r: r.value)
@pytest.mark.parametrize("attention_backend", ["auto", "torch_sdpa"])
def test_warm_up_leaves_the_engine_as_it_found_it(tiny_llama, role, attention_backend):
    config = dict(
        role=role,
        num_blocks=32,
        block_size=4,
        enable_kv_events=True,
        attention_backend=attention_backend,
    )
    engine, cold = make_engine(tiny_llama, **config), make_engine(tiny_llama, **config)
    before, kv_before = _state(engine), engine.kv_cache.kv.clone()  # NaN-poisoned blocks
    seconds = engine.warm_up()
    assert 0 < seconds < 60
    assert _state(engine) == before
    assert before["free"] == engine.kv_cache.num_blocks and before["hashes"] == []
    torch.testing.assert_close(engine.kv_cache.kv, kv_before, rtol=0, atol=0, equal_nan=True)
    engine.check_integrity()
    # The free list hands out the same blocks in the same (shuffled) order as an unwarmed one's.
    num_blocks = engine.kv_cache.num_blocks
    assert engine.kv_cache.pool.allocate(num_blocks) == cold.kv_cache.pool.allocate(num_blocks)


@pytest.mark.parametrize("max_model_len", [1, 2, 5])
def test_warm_up_fits_a_short_max_model_len(tiny_llama, max_model_len):
    engine = make_engine(tiny_llama, num_blocks=2, block_size=4, max_model_len=max_model_len)
    assert engine.warm_up() > 0
    assert engine.kv_cache.pool.num_free_blocks == 2
    engine.check_integrity()


def test_warm_up_refuses_when_the_blocks_are_taken(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=4, block_size=4)
    engine.add_request(list(range(2, 15)), SamplingParams(max_tokens=3, **GREEDY), "busy")
    engine.step()  # 13 prompt tokens + 1: all 4 blocks in use
    with pytest.raises(ResourceExhaustedError, match="free KV blocks"):
        engine.warm_up()
    assert engine.kv_cache.pool.num_free_blocks == 0 and list(engine.requests) == ["busy"]
    engine.check_integrity()


def _requests() -> dict[str, tuple[list[int], SamplingParams]]:
    return {
        "greedy": (list(range(3, 40)), SamplingParams(max_tokens=10, **GREEDY)),
        "short": ([5, 6], SamplingParams(max_tokens=6, **GREEDY)),
        # No seed: the engine draws one from its own seeded RNG, which warm-up must not consume.
        "sampled": (
            [7, 8, 9, 10, 11],
            SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True),
        ),
    }


def test_both_engine_outputs_are_unchanged_by_warm_up(tiny_model):
    outputs = []
    for warm in (False, True):
        engine = make_engine(tiny_model, num_blocks=64, block_size=4)
        if warm:
            engine.warm_up()
        outputs.append(run_to_completion(engine, _requests()))
    assert outputs[0] == outputs[1]  # the tokens, and what every step's forward computed


def _disaggregated(model: str, warm: bool):
    """A PREFILL and a DECODE engine (both warmed up when `warm`) run `_requests()`; returns the
    outputs, each handle's prefill blocks and each decode request's block table."""
    transfer = InMemoryKVTransfer()
    engines = [
        make_engine(model, role=role, num_blocks=64, block_size=4, kv_transfer=transfer)
        for role in (EngineRole.PREFILL, EngineRole.DECODE)
    ]
    prefill, decode = engines
    if warm:
        for engine in engines:
            engine.warm_up()
    handles = {}
    for rid, (prompt, params) in _requests().items():
        prefill.add_request(prompt, params, request_id=rid)
        (out,) = prefill.step()
        handles[rid] = out.kv_handle
        decode.add_request(prompt, params, request_id=rid, kv_handle=out.kv_handle)
    tables, outputs = {}, {}
    while decode.has_unfinished_requests():
        for rid, request in decode.requests.items():
            tables.setdefault(rid, list(request.block_table))
        for out in decode.step():
            if out.finished:
                outputs[out.request_id] = out.output_token_ids
        decode.check_integrity()
    return outputs, {rid: h.block_ids for rid, h in handles.items()}, tables


def test_prefill_and_decode_outputs_are_unchanged_by_warm_up(tiny_model):
    assert _disaggregated(tiny_model, warm=True) == _disaggregated(tiny_model, warm=False)
