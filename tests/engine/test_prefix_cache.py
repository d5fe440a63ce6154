"""Automatic prefix caching in the engine: the cached_tokens rule, equivalence with hits,
eviction, block identity, events, and the decode side's own cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.engine import EngineRole, SamplingParams, block_hash
from services.engine.block_hash import ROOT_HASH, block_hashes
from services.engine.errors import InvalidRequestError
from services.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from services.kv_transfer.in_memory import InMemoryKVTransfer
from tests.engine.helpers import GREEDY, make_engine
from tests.reference import assert_equivalent, hf_greedy

BLOCK = 16


def _run(engine, prompt, max_tokens=8, request_id="r", cache_salt=None):
    """One request alone, to completion (integrity checked every step): (tokens, cached_tokens)."""
    engine.add_request(
        prompt,
        SamplingParams(max_tokens=max_tokens, **GREEDY),
        request_id=request_id,
        cache_salt=cache_salt,
    )
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                result = (out.output_token_ids, out.num_cached_tokens)
        engine.check_integrity()
    return result


def _run_batch(engine, prompts: dict[str, list[int]], max_tokens: int):
    """Requests in one batch, to completion: {request_id: (tokens, cached_tokens)}."""
    for request_id, prompt in prompts.items():
        engine.add_request(
            prompt, SamplingParams(max_tokens=max_tokens, **GREEDY), request_id=request_id
        )
    results = {}
    while engine.has_unfinished_requests():
        results.update(
            {
                o.request_id: (o.output_token_ids, o.num_cached_tokens)
                for o in engine.step()
                if o.finished
            }
        )
        engine.check_integrity()
    return results


# Lengths checked against transformers too: every offset in a block with 0, 1 and 2 blocks
# cached, and the block edges above (every other length: warm output == cold output).
# Both sides of every block boundary (transformers runs each: the suite's time budget).
REFERENCE_LENGTHS = {
    1,
    2,
    3,
    *(n + d for n in range(16, 81, 16) for d in (-1, 0, 1) if n + d <= 80),
}


def test_cached_tokens_rule_for_every_prompt_length_1_to_80(default_model, real_text_ids):
    """Every length sent twice (each time all 80 in one batch): the first send hits nothing, the
    second reuses every full block before the last prompt token, (n - 1) // 16 * 16 tokens
    (0 for n <= 16, 16 for n = 32, 64 for n = 80); the second output equals the first, so hits
    change nothing, and the first meets the equivalence rule against transformers (at
    REFERENCE_LENGTHS). The counters add up exactly."""
    engine = make_engine(default_model, num_blocks=1024)
    # Disjoint texts, so no two lengths share a block.
    prompts = {n: real_text_ids[n * 100 : n * 100 + n] for n in range(1, 81)}
    cold = _run_batch(engine, {f"cold-{n}": p for n, p in prompts.items()}, 3)
    warm = _run_batch(engine, {f"warm-{n}": p for n, p in prompts.items()}, 3)
    for n, prompt in prompts.items():
        assert (cold[f"cold-{n}"][1], warm[f"warm-{n}"][1]) == (0, (n - 1) // BLOCK * BLOCK), n
        assert warm[f"warm-{n}"][0] == cold[f"cold-{n}"][0], n  # a hit changes no token
        if n in REFERENCE_LENGTHS:
            reference = hf_greedy(default_model, prompt, 3)
            assert_equivalent(cold[f"cold-{n}"][0], reference, f"cold n={n}")
    hits = sum((n - 1) // BLOCK * BLOCK for n in prompts)
    assert (engine.scheduler.prefix_cache_queries, engine.scheduler.prefix_cache_hits) == (
        2 * sum(prompts),
        hits,
    )
    assert engine.scheduler.num_prompt_tokens_computed == 2 * sum(prompts) - hits


def test_hit_stops_at_a_middle_block_that_was_evicted(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=64, enable_kv_events=True)
    prompt = list(range(2, 2 + 3 * BLOCK + 5))  # blocks A B C + 5 tokens
    cold, _ = _run(engine, prompt)
    hashes = block_hashes(prompt, BLOCK, engine.model_id)
    a, b, c = engine.kv_cache.pool.lookup(hashes)
    engine.take_kv_events()
    assert engine.kv_cache.pool.evict(b)
    assert engine.take_kv_events() == [BlockRemoved((hashes[1],))]
    again, cached = _run(engine, prompt, request_id="after-eviction")
    assert (again, cached) == (cold, BLOCK)  # A only: C is still cached, but unreachable past B
    # B is stored again by the recompute; C's hash stays with its old block, which holds the
    # same KV, so the next request reuses A, the new B and the old C.
    (stored,) = engine.take_kv_events()
    assert stored.block_hashes == (hashes[1],) and stored.parent_block_hash == hashes[0]
    third, cached = _run(engine, prompt, request_id="third")
    assert (third, cached) == (cold, 3 * BLOCK)
    assert engine.kv_cache.pool.lookup(hashes)[0::2] == [a, c]


def test_prompts_sharing_all_but_their_last_block_never_share_it(tiny_llama):
    """Two 48-token prompts (exact multiples of block_size) that differ only in their last
    token: they share blocks 0-1, never block 2, in one batch or one after the other."""
    engine = make_engine(tiny_llama, num_blocks=64)
    first = list(range(2, 2 + 3 * BLOCK))
    second = first[:-1] + [first[-1] + 100]
    assert (
        block_hashes(first, BLOCK, engine.model_id)[2]
        != block_hashes(second, BLOCK, engine.model_id)[2]
    )
    out_first, cached_first = _run(engine, first, request_id="first")
    out_second, cached_second = _run(engine, second, request_id="second")
    assert (cached_first, cached_second) == (0, 2 * BLOCK)
    pool = engine.kv_cache.pool
    first_blocks = pool.lookup(block_hashes(first, BLOCK, engine.model_id))
    second_blocks = pool.lookup(block_hashes(second, BLOCK, engine.model_id))
    assert first_blocks[:2] == second_blocks[:2] and first_blocks[2] != second_blocks[2]
    for prompt, out in ((first, out_first), (second, out_second)):
        assert_equivalent(out, hf_greedy(tiny_llama, prompt, 8), f"last token {prompt[-1]}")
    # In one batch, on a fresh engine: same result, and the batch's block tables share exactly 2.
    batch = make_engine(tiny_llama, num_blocks=64, seed=1)
    for rid, prompt in (("first", first), ("second", second)):
        batch.add_request(prompt, SamplingParams(max_tokens=8, **GREEDY), request_id=rid)
    batch.step()
    tables = [r.block_table for r in batch.scheduler.running]
    assert len(set(tables[0]) & set(tables[1])) == 0  # nothing cached yet when both were admitted
    outs = {}
    while batch.has_unfinished_requests():
        outs.update({o.request_id: o.output_token_ids for o in batch.step() if o.finished})
    assert outs == {"first": out_first, "second": out_second}


def test_same_prefix_different_salt_or_model_shares_nothing(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=64)
    prompt = list(range(2, 2 + 2 * BLOCK + 1))
    _run(engine, prompt, request_id="a", cache_salt="tenant-a")
    assert _run(engine, prompt, request_id="b", cache_salt="tenant-b")[1] == 0
    assert _run(engine, prompt, request_id="c", cache_salt="tenant-a")[1] == 2 * BLOCK
    assert _run(engine, prompt, request_id="d")[1] == 0
    assert block_hashes(prompt, BLOCK, "other-model@0") != block_hashes(
        prompt, BLOCK, engine.model_id
    )
    for bad in ("", 5, "x" * 1025):
        with pytest.raises(InvalidRequestError, match="cache_salt"):
            engine.add_request(prompt, SamplingParams(), cache_salt=bad)


def test_a_long_salt_is_hashed_once_per_call_not_once_per_block(tiny_llama, monkeypatch):
    calls = []
    monkeypatch.setattr(block_hash, "extra_key", lambda *a: calls.append(a) or b"k" * 32)
    assert (
        len(block_hash.block_hashes(list(range(160)), BLOCK, "m", "s" * 1000)) == 10
        and len(calls) == 1
    )


def test_events_tell_exactly_which_hashes_the_cache_holds(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=6, enable_kv_events=True)
    prompt = list(range(2, 2 + 2 * BLOCK + 3))  # 2 full blocks, then output fills block 3
    _run(engine, prompt, max_tokens=14)
    hashes = block_hashes(prompt, BLOCK, engine.model_id)
    events = engine.take_kv_events()
    assert events[0] == BlockStored(tuple(hashes), ROOT_HASH, tuple(prompt[: 2 * BLOCK]), BLOCK)
    # The output completed block 3 (3 prompt tokens + 13 of the 14 generated ones had KV).
    assert (
        len(events) == 2
        and events[1].parent_block_hash == hashes[1]
        and len(events[1].block_hashes) == 1
    )
    held = set(hashes) | set(events[1].block_hashes)
    # 5 more full blocks: the 3 free ones, then the 2 least recently freed cached ones (evicted).
    _run(engine, list(range(300, 300 + 5 * BLOCK)), max_tokens=1, request_id="big")
    for event in engine.take_kv_events():
        if isinstance(event, BlockRemoved):
            held -= set(event.block_hashes)
        elif isinstance(event, BlockStored):
            held |= set(event.block_hashes)
    cached = {engine.kv_cache.pool.block_hash(b) for b in range(6)} - {None}
    assert held == cached and len(cached) == 6 and len(held & set(hashes)) == 1
    assert engine.reset_prefix_cache() == 6
    assert engine.take_kv_events() == [AllBlocksCleared()]
    assert _run(engine, prompt, request_id="after-reset")[1] == 0


def test_decode_engine_keeps_its_own_prefix_cache(tiny_llama):
    """A follow-up turn (turn 1's prompt + answer + a new question) pulls only the blocks the
    decode engine lacks; turn 1's generated blocks come from its own cache."""
    transfer = InMemoryKVTransfer()
    prefill = make_engine(tiny_llama, role=EngineRole.PREFILL, num_blocks=256, kv_transfer=transfer)
    decode = make_engine(
        tiny_llama, role=EngineRole.DECODE, num_blocks=256, kv_transfer=transfer, seed=1
    )
    both = make_engine(tiny_llama, num_blocks=256, seed=2)
    bytes_per_block = decode.kv_cache.spec.bytes_per_block

    def turn(prompt, request_id):
        prefill.add_request(prompt, SamplingParams(max_tokens=20, **GREEDY), request_id=request_id)
        (handoff,) = prefill.step()
        before = transfer.receiver.bytes_transferred
        decode.add_request(
            prompt,
            SamplingParams(max_tokens=20, **GREEDY),
            request_id=request_id,
            kv_handle=handoff.kv_handle,
        )
        while decode.has_unfinished_requests():
            for out in decode.step():
                if out.finished:
                    result = out
            decode.check_integrity()
        assert result.output_token_ids == _run(both, prompt, 20, request_id)[0]
        return result, (transfer.receiver.bytes_transferred - before) // bytes_per_block

    first_prompt = list(range(2, 2 + 40))
    first, pulled = turn(first_prompt, "turn-1")
    assert (first.num_cached_tokens, pulled) == (0, 3)
    follow_up = first_prompt + first.output_token_ids + list(range(400, 420))  # 80 tokens: 5 blocks
    second, pulled = turn(follow_up, "turn-2")
    # Turn 1 left 40 + 19 tokens with KV on the decode engine: 3 full blocks cached.
    assert (second.num_cached_tokens, pulled) == (3 * BLOCK, 2)
    assert prefill.num_pinned_blocks == 0


def test_block_hashes_are_equal_across_processes(tiny_llama):
    """Two fresh interpreters with different PYTHONHASHSEEDs store the same hashes for the same
    prompt, equal to this process's."""
    prompt = list(range(2, 2 + 3 * BLOCK + 1))
    script = (
        "import json, sys\n"
        "from tests.engine.helpers import GREEDY, make_engine\n"
        "from services.engine import LLM, SamplingParams\n"
        f"engine = make_engine({tiny_llama!r}, num_blocks=16, enable_kv_events=True)\n"
        f"LLM(engine).generate([{prompt!r}], SamplingParams(max_tokens=1, **GREEDY))\n"
        "print(json.dumps([h.hex() for e in engine.take_kv_events() for h in e.block_hashes]))\n"
    )
    outputs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", script],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
        )
        assert done.returncode == 0, done.stderr[-2000:]
        outputs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    engine = make_engine(tiny_llama, num_blocks=16)
    expected = [h.hex() for h in block_hashes(prompt, BLOCK, engine.model_id)]
    assert outputs[0] == outputs[1] == expected and len(expected) == 3
