"""A migrated request (`add_request(..., output_token_ids=...)`) continues as if its first worker
had never failed: greedy, seeded sampling, penalties, logprobs, on one engine and across a
PREFILL -> DECODE hand-off, resumed at any token."""

from __future__ import annotations

import pytest

from services.engine import EngineRole, SamplingParams
from services.engine.errors import InvalidRequestError
from services.kv_transfer.in_memory import InMemoryKVTransfer
from tests.engine.helpers import GREEDY, make_engine

PROMPT = [11, 42, 7, 300, 5, 19, 88, 2, 61, 17, 250, 9, 33, 4, 8, 120, 77, 3, 15]
MAX_TOKENS = 24
PARAMS = {
    "greedy": SamplingParams(max_tokens=MAX_TOKENS, **GREEDY),
    "seeded": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=11),
    "penalties": SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0.7,
        seed=5,
        repetition_penalty=1.3,
        frequency_penalty=0.6,
        presence_penalty=0.4,
        ignore_eos=True,
    ),
}
RESUME_AT = [1, 7, 16, 23]  # outputs already generated when the first worker failed


def _run(engine, request_id: str, params: SamplingParams, resumed: list[int] | None = None):
    """Run one request to its end; returns (all output ids, ids streamed as new, logprobs)."""
    engine.add_request(PROMPT, params, request_id=request_id, output_token_ids=resumed)
    final, new, logprobs = None, [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            new += out.new_token_ids
            logprobs += out.new_logprobs
            if out.finished:
                final = out
        engine.check_integrity()
    assert final is not None
    assert engine.kv_cache.pool.num_free_blocks == engine.kv_cache.num_blocks
    return final.output_token_ids, new, logprobs


@pytest.mark.parametrize("kind", list(PARAMS))
def test_resumed_request_continues_the_uninterrupted_run(tiny_llama, kind):
    params = PARAMS[kind]
    engine = make_engine(tiny_llama, num_blocks=256)
    full, _, _ = _run(engine, "whole", params)
    assert len(full) == MAX_TOKENS
    for k in RESUME_AT:
        outputs, new, _ = _run(engine, f"resumed-{k}", params, full[:k])
        assert outputs == full, f"{kind}: resumed after {k} tokens"
        assert new == full[k:]  # the earlier outputs are never reported again as new


def test_resumed_through_prefill_and_decode_engines(tiny_llama):
    transfer = InMemoryKVTransfer()
    both = make_engine(tiny_llama, num_blocks=256)
    prefill = make_engine(tiny_llama, role=EngineRole.PREFILL, num_blocks=256, kv_transfer=transfer)
    decode = make_engine(tiny_llama, role=EngineRole.DECODE, num_blocks=256, kv_transfer=transfer)
    for kind, params in PARAMS.items():
        full, _, _ = _run(both, f"whole-{kind}", params)
        for k in RESUME_AT:
            rid = f"{kind}-{k}"
            prefill.add_request(PROMPT, params, request_id=rid, output_token_ids=full[:k])
            (out,) = prefill.step()
            if k == MAX_TOKENS - 1:  # the prefill's token is the last one: nothing to hand off
                assert out.finish_reason == "length" and out.output_token_ids == full
                continue
            handle = out.kv_handle
            assert out.finish_reason == "prefilled" and handle is not None
            assert handle.num_tokens == len(PROMPT) + k  # the KV of prompt + earlier outputs
            assert handle.first_token_id == full[k]
            decode.add_request(
                PROMPT, params, request_id=rid, kv_handle=handle, output_token_ids=full[:k]
            )
            final, streamed = None, []
            while decode.has_unfinished_requests():
                for step_out in decode.step():
                    streamed += step_out.new_token_ids
                    final = step_out if step_out.finished else final
                decode.check_integrity()
            assert final is not None and final.output_token_ids == full, f"{kind} after {k}"
            assert streamed == full[k + 1 :]
    assert prefill.num_pinned_blocks == 0
    assert decode.kv_cache.pool.num_free_blocks == decode.kv_cache.num_blocks


def test_resumed_logprobs_cover_only_new_tokens(tiny_llama):
    params = SamplingParams(max_tokens=10, logprobs=2, **GREEDY)
    engine = make_engine(tiny_llama, num_blocks=256)
    full, _, whole_logprobs = _run(engine, "whole", params)
    outputs, new, logprobs = _run(engine, "resumed", params, full[:4])
    assert outputs == full and len(logprobs) == len(new) == 6
    for got, want in zip(logprobs, whole_logprobs[4:], strict=True):
        assert got.token_id == want.token_id
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)


@pytest.mark.parametrize(
    ("resumed", "max_tokens", "message"),
    [
        ([1, 2, 3], 3, "max_tokens is 3"),
        ([1, -1], 8, "outside"),
        ([1, "x"], 8, "list of integers"),
    ],
)
def test_bad_output_token_ids_are_named(tiny_llama, resumed, max_tokens, message):
    engine = make_engine(tiny_llama, num_blocks=64)
    with pytest.raises(InvalidRequestError, match="output_token_ids") as info:
        engine.add_request(
            PROMPT, SamplingParams(max_tokens=max_tokens, **GREEDY), output_token_ids=resumed
        )
    assert message in str(info.value)
    assert not engine.has_unfinished_requests()


def test_prompt_plus_resumed_beyond_max_model_len(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=64, max_model_len=len(PROMPT) + 4)
    with pytest.raises(InvalidRequestError, match="already generated"):
        engine.add_request(
            PROMPT, SamplingParams(max_tokens=8, **GREEDY), output_token_ids=[1, 2, 3, 4]
        )
