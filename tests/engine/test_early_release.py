"""A release that reaches the source before the publish (a client that cancelled while its
prefill ran) unpins the blocks as soon as they are published."""

from __future__ import annotations

from services.engine import EngineRole, SamplingParams
from services.kv_transfer.in_memory import InMemoryKVTransfer
from services.kv_transfer.lease import TransferStatus
from tests.engine.helpers import GREEDY, make_engine


def test_release_before_publish_unpins_at_publish(tiny_llama):
    transfer = InMemoryKVTransfer()
    prefill = make_engine(tiny_llama, role=EngineRole.PREFILL, num_blocks=64, kv_transfer=transfer)
    prefill.add_request([5, 6, 7, 8], SamplingParams(max_tokens=4, **GREEDY), request_id="late")
    assert transfer.sender.release("late") is False  # nothing published yet: remembered
    outputs = prefill.step()
    assert [o.request_id for o in outputs] == ["late"] and outputs[0].kv_handle is not None
    assert prefill.num_pinned_blocks == 0 and prefill.kv_cache.pool.num_free_blocks == 64
    assert transfer.sender.status("late") == TransferStatus.COMPLETED
    assert transfer.sender.release("late") is False  # a duplicate is harmless


def test_release_of_an_other_request_does_not_touch_this_one(tiny_llama):
    transfer = InMemoryKVTransfer()
    prefill = make_engine(tiny_llama, role=EngineRole.PREFILL, num_blocks=64, kv_transfer=transfer)
    transfer.sender.release("someone-else")
    prefill.add_request([5, 6, 7, 8], SamplingParams(max_tokens=4, **GREEDY), request_id="mine")
    prefill.step()
    assert (
        prefill.num_pinned_blocks == 1
        and transfer.sender.status("mine") == TransferStatus.PUBLISHED
    )
