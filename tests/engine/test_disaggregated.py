"""A PREFILL engine and a DECODE engine joined by the in-memory transfer behave like one BOTH
engine."""

from __future__ import annotations

import dataclasses
import random

import pytest

from services.engine import EngineRole, SamplingParams
from services.engine.errors import InvalidRequestError, KVHandshakeError
from services.kv_transfer.in_memory import InMemoryKVTransfer
from services.kv_transfer.lease import TransferStatus
from tests.engine.helpers import GREEDY, make_engine, run_to_completion

LENS = [1, 15, 16, 17, 33, 100]


def _pair(model: str, block_size: int = 16):
    transfer = InMemoryKVTransfer()
    prefill = make_engine(
        model, role=EngineRole.PREFILL, block_size=block_size, num_blocks=512, kv_transfer=transfer
    )
    decode = make_engine(
        model, role=EngineRole.DECODE, block_size=block_size, num_blocks=512, kv_transfer=transfer
    )
    return prefill, decode, transfer


def _prefilled(prefill, request_id: str, prompt=(7, 8)):
    prefill.add_request(list(prompt), SamplingParams(max_tokens=4, **GREEDY), request_id=request_id)
    (out,) = prefill.step()
    return out.kv_handle


def _disaggregated(prefill, decode, requests):
    """Prefill every request, hand each KV handle to the decode engine, decode to the end."""
    handles = {}
    for rid, (prompt, params) in requests.items():
        prefill.add_request(prompt, params, request_id=rid)
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            assert (
                out.finished and out.finish_reason == "prefilled" and len(out.output_token_ids) == 1
            )
            handles[out.request_id] = out.kv_handle
        prefill.check_integrity()
    assert prefill.kv_cache.pool.num_used_blocks == sum(len(h.block_ids) for h in handles.values())
    for rid, (prompt, params) in requests.items():
        decode.add_request(prompt, params, request_id=rid, kv_handle=handles[rid])
    finished, steps = {}, []
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.finished:
                finished[out.request_id] = out.output_token_ids
        steps.append(dict(decode.last_forward_tokens))
        decode.check_integrity()
    return finished, steps, handles


@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_plus_decode_equals_both(tiny_model, block_size):
    rng = random.Random(7)
    requests = {
        f"r{n}": (
            [rng.randrange(2, 512) for _ in range(n)],
            SamplingParams(max_tokens=12, **GREEDY),
        )
        for n in LENS
    }
    requests["sampled"] = (
        [5, 6, 7, 8, 9],
        SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3),
    )
    both_outs, _ = run_to_completion(
        make_engine(tiny_model, block_size=block_size, num_blocks=512), requests
    )
    prefill, decode, transfer = _pair(tiny_model, block_size)
    disagg_outs, steps, handles = _disaggregated(prefill, decode, requests)
    assert disagg_outs == both_outs
    # The DECODE engine never ran a prompt position: one token per request per forward.
    assert decode.scheduler.num_prompt_tokens_computed == 0
    assert all(n == 1 for step in steps for n in step.values())
    assert len(steps[0]) == len(requests)
    # Every transfer completed and the prefill side released every pinned block.
    assert all(transfer.sender.status(rid) == TransferStatus.COMPLETED for rid in handles)
    assert prefill.kv_cache.pool.num_free_blocks == prefill.kv_cache.num_blocks
    assert not prefill.pinned
    assert decode.kv_cache.pool.num_free_blocks == decode.kv_cache.num_blocks


def test_decode_uses_the_transferred_kv(tiny_llama):
    """Zeroing a transferred block changes the output: decode really reads what it received."""
    prompt = list(range(10, 60))
    params = SamplingParams(max_tokens=8, **GREEDY)
    prefill, decode, transfer = _pair(tiny_llama)
    clean, _, _ = _disaggregated(prefill, decode, {"a": (prompt, params)})
    prefill, decode, transfer = _pair(tiny_llama)
    original_read = prefill.export.read_kv

    def corrupted_read(handle, first_block=0):
        data = original_read(handle, first_block)
        data[:, :, 1] = 0.0  # zero the second block of every layer's K and V
        return data

    prefill.export.read_kv = corrupted_read
    corrupted, _, _ = _disaggregated(prefill, decode, {"a": (prompt, params)})
    assert corrupted["a"] != clean["a"]


def test_max_tokens_one_ends_on_the_prefill_side(tiny_llama):
    """The first token already ends the request: no handle, nothing pinned, nothing to decode."""
    prefill, decode, transfer = _pair(tiny_llama)
    prefill.add_request([3, 4, 5], SamplingParams(max_tokens=1, **GREEDY), request_id="a")
    (out,) = prefill.step()
    assert out.finished and out.finish_reason == "length" and out.kv_handle is None
    assert prefill.kv_cache.pool.num_free_blocks == prefill.kv_cache.num_blocks


def test_decode_finishes_at_admission_when_first_token_ends_it(tiny_llama):
    """A handle whose first token already meets max_tokens completes the transfer, runs nothing."""
    prefill, decode, transfer = _pair(tiny_llama)
    prefill.add_request([3, 4, 5], SamplingParams(max_tokens=5, **GREEDY), request_id="a")
    (out,) = prefill.step()
    decode.add_request(
        [3, 4, 5], SamplingParams(max_tokens=1, **GREEDY), request_id="a", kv_handle=out.kv_handle
    )
    (done,) = decode.step()
    assert (
        done.finished
        and done.finish_reason == "length"
        and done.output_token_ids == out.output_token_ids
    )
    assert decode.last_forward_tokens == {}
    assert transfer.sender.status("a") == TransferStatus.COMPLETED
    assert prefill.kv_cache.pool.num_free_blocks == prefill.kv_cache.num_blocks


def test_abort_pinned_request_frees_blocks_and_revokes(tiny_llama):
    prefill, decode, transfer = _pair(tiny_llama)
    prefill.add_request(list(range(2, 40)), SamplingParams(max_tokens=4, **GREEDY), request_id="a")
    (out,) = prefill.step()
    assert prefill.kv_cache.pool.num_used_blocks == 3
    prefill.abort("a")
    assert prefill.kv_cache.pool.num_free_blocks == prefill.kv_cache.num_blocks
    assert transfer.sender.status("a") == TransferStatus.REVOKED
    decode.add_request(
        list(range(2, 40)),
        SamplingParams(max_tokens=4, **GREEDY),
        request_id="a",
        kv_handle=out.kv_handle,
    )
    decode.add_request(
        [7, 8],
        SamplingParams(max_tokens=4, **GREEDY),
        request_id="b",
        kv_handle=_prefilled(prefill, "b"),
    )
    outs = {o.request_id: o for o in decode.step()}
    assert outs["a"].finished and outs["a"].finish_reason == "error"  # its pull failed
    assert not outs["b"].finished and decode.last_forward_tokens == {"b": 1}  # the other goes on
    decode.abort("b")
    assert decode.kv_cache.pool.num_free_blocks == decode.kv_cache.num_blocks


def test_role_checks(tiny_llama):
    prefill, decode, _ = _pair(tiny_llama)
    handle = _prefilled(prefill, "a")
    with pytest.raises(InvalidRequestError, match="kv_handle"):
        prefill.add_request([7, 8], SamplingParams(), request_id="b", kv_handle=handle)


def test_a_decode_engine_prefills_locally_beside_remote_requests(tiny_llama):
    """Conditional disaggregation's local path: a DECODE engine given no KV handle prefills the
    prompt itself (chunked, mixed into the running batch's steps) and generates the same greedy
    tokens as a BOTH engine, while a remote request decodes in the same steps."""
    prefill, decode, _ = _pair(tiny_llama)
    decode = make_engine(
        tiny_llama, role=EngineRole.DECODE, num_blocks=512, max_num_batched_tokens=16,
        kv_receiver=decode.kv_receiver,
    )  # fmt: skip
    params = SamplingParams(max_tokens=6, **GREEDY)
    remote, local = list(range(2, 30)), list(range(40, 80))
    decode.add_request(remote, params, request_id="r", kv_handle=_prefilled(prefill, "r", remote))
    decode.add_request(local, params, request_id="l")  # no handle: prefilled here
    finished, steps = {}, []
    while decode.has_unfinished_requests():
        finished |= {o.request_id: o.output_token_ids for o in decode.step() if o.finished}
        steps.append(dict(decode.last_forward_tokens))
        decode.check_integrity()
    assert any(s.get("r") == 1 and s.get("l", 0) > 1 for s in steps)  # mixed in one step
    reference, _ = run_to_completion(
        make_engine(tiny_llama, num_blocks=512), {"r": (remote, params), "l": (local, params)}
    )
    assert finished == reference


def test_abort_on_decode_before_admission_unpins_the_source(tiny_llama):
    prefill, decode, transfer = _pair(tiny_llama)
    prefill.add_request(list(range(2, 40)), SamplingParams(max_tokens=4, **GREEDY), request_id="a")
    (out,) = prefill.step()
    decode.add_request(
        list(range(2, 40)),
        SamplingParams(max_tokens=4, **GREEDY),
        request_id="a",
        kv_handle=out.kv_handle,
    )
    decode.abort("a")
    assert prefill.kv_cache.pool.num_free_blocks == prefill.kv_cache.num_blocks
    assert decode.kv_cache.pool.num_free_blocks == decode.kv_cache.num_blocks
    assert not decode.has_unfinished_requests() and decode.step() == []


def test_handle_must_match_the_request(tiny_llama):
    prefill, decode, transfer = _pair(tiny_llama)
    handle = _prefilled(prefill, "a", prompt=range(2, 30))
    cases = [
        (dict(request_id="other"), "is for request 'a'"),
        (dict(prompt=list(range(2, 31))), "num_tokens"),
        (
            dict(kv_handle=dataclasses.replace(handle, block_ids=handle.block_ids[:1])),
            "blocks cannot hold",
        ),
        (dict(kv_handle=dataclasses.replace(handle, first_token_id=10**6)), "first_token_id"),
    ]
    for overrides, message in cases:
        kwargs = {"prompt": list(range(2, 30)), "request_id": "a", "kv_handle": handle, **overrides}
        with pytest.raises(InvalidRequestError, match=message):
            decode.add_request(kwargs.pop("prompt"), SamplingParams(max_tokens=4), **kwargs)
    assert not decode.has_unfinished_requests() and decode.kv_cache.pool.num_used_blocks == 0


def test_dtype_and_block_size_mismatch_is_refused_by_the_handshake(tiny_llama):
    """KV from an engine with another dtype or block size is refused before any block is
    reserved, with an error naming each differing field; the source unpins."""
    transfer = InMemoryKVTransfer()
    prefill = make_engine(tiny_llama, role=EngineRole.PREFILL, num_blocks=64, kv_transfer=transfer)
    decode = make_engine(
        tiny_llama,
        role=EngineRole.DECODE,
        num_blocks=64,
        kv_transfer=transfer,
        dtype="bfloat16",
        block_size=8,
    )
    handle = _prefilled(prefill, "a", prompt=range(2, 30))
    with pytest.raises(
        KVHandshakeError,
        match=r"dtype: float32 at the source \(prefill\), bfloat16 at the "
        r"destination \(decode\); block_size: 16 at the source",
    ):
        decode.add_request(
            list(range(2, 30)),
            SamplingParams(max_tokens=4, **GREEDY),
            request_id="a",
            kv_handle=handle,
        )
    assert not decode.requests and decode.kv_cache.pool.num_free_blocks == 64
    assert prefill.kv_cache.pool.num_free_blocks == 64  # the source was told to unpin
    decode.check_integrity()


def test_source_serves_only_the_pinned_requests_own_blocks(tiny_llama):
    prefill, decode, transfer = _pair(tiny_llama)
    handle = _prefilled(prefill, "a", prompt=range(2, 30))
    forged = dataclasses.replace(
        handle, block_ids=tuple(b for b in range(2) if b not in handle.block_ids) or (999,)
    )
    with pytest.raises(KeyError):
        prefill.export.read_kv(forged)
    assert prefill.export.read_kv(handle).shape[2] == len(handle.block_ids)
