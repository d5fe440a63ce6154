"""The Generation servicer's conversions (services/router/convert.py): a GenerateRequest becomes
the flow's GenerationRequest with every field, bad values name their field, and the flow's
outputs become GenerateResponse messages (usage and timings on the last one only)."""

from __future__ import annotations

import dataclasses

import pytest

from services.common.pb import common_pb2, generate_pb2
from services.engine.errors import InvalidRequestError
from services.engine.outputs import TokenLogprobs
from services.engine.sampling_params import SamplingParams
from services.router.convert import output_to_proto, request_from_proto
from services.router.flow.messages import (
    ChatMessage,
    GenerationOutput,
    GenerationRequest,
    Timings,
    Usage,
)

TIMINGS = Timings(0.5, 2.0, 0.01, 0.3, 0.2, 1.4, 0.001, 0.1, 0.05, 0.02, "remote", 1, 0.25)


def test_every_request_field_is_carried():
    msg = generate_pb2.GenerateRequest(
        request_id="client-id",
        chat=generate_pb2.ChatMessages(
            messages=[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
        ),
        sampling=common_pb2.SamplingParams(
            max_tokens=7,
            temperature=0.5,
            top_k=3,
            seed=2**64 - 1,
            stop=["\n", "END"],
            stop_token_ids=[2],
            ignore_eos=True,
            logprobs=2,
            presence_penalty=0.5,
            logit_bias={5: -100.0},
        ),
        cache_salt="tenant-a",
        itl_objective_ms=80.0,
        tpot_objective_ms=45.0,
        ttft_objective_ms=900.0,
    )
    request = request_from_proto(msg, "settled-id")
    assert request == GenerationRequest(
        chat=(ChatMessage("system", "Be terse."), ChatMessage("user", "Hi")),
        sampling=SamplingParams(
            max_tokens=7,
            temperature=0.5,
            top_k=3,
            seed=2**64 - 1,
            stop_token_ids=(2,),
            ignore_eos=True,
            logprobs=2,
            presence_penalty=0.5,
            logit_bias={5: -100.0},
        ),
        stop=("\n", "END"),
        cache_salt="tenant-a",
        request_id="settled-id",
        itl_objective_ms=80.0,
        tpot_objective_ms=45.0,
        ttft_objective_ms=900.0,
    )


def test_each_prompt_kind_and_proto3_defaults():
    text = request_from_proto(generate_pb2.GenerateRequest(text=""), "r")
    assert (text.text, text.token_ids, text.chat) == ("", None, None)
    assert text.sampling == SamplingParams() and text.stop == () and text.cache_salt is None
    ids = request_from_proto(
        generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1, 2])), "r"
    )
    assert (ids.text, ids.token_ids, ids.chat) == (None, (1, 2), None)
    chat = request_from_proto(generate_pb2.GenerateRequest(chat=generate_pb2.ChatMessages()), "r")
    assert chat.chat == ()  # set but empty: the flow refuses it, naming the prompt


@pytest.mark.parametrize(
    "msg, field",
    [
        (generate_pb2.GenerateRequest(), "prompt"),
        (generate_pb2.GenerateRequest(text="a", sampling={"max_tokens": 0}), "max_tokens"),
        (generate_pb2.GenerateRequest(text="a", sampling={"top_p": 2.0}), "top_p"),
        (generate_pb2.GenerateRequest(text="a", sampling={"stop": ["x", ""]}), "stop"),
        (generate_pb2.GenerateRequest(text="a", sampling={"logit_bias": {-1: 1.0}}), "logit_bias"),
        (generate_pb2.GenerateRequest(text="a", cache_salt="s" * 1025), "cache_salt"),
    ],
)
def test_bad_requests_name_the_field(msg, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        request_from_proto(msg, "r")


def test_a_request_holds_exactly_one_prompt():
    with pytest.raises(InvalidRequestError, match="^prompt: set exactly one"):
        GenerationRequest(text="a", chat=(ChatMessage("user", "b"),))
    request = GenerationRequest(token_ids=[3, 4], stop=["x"])  # lists are kept as tuples
    assert request.token_ids == (3, 4) and request.stop == ("x",)
    assert dataclasses.replace(request, request_id="r-0").token_ids == (3, 4)


def test_a_streamed_output_has_no_usage_or_timings():
    logprob = TokenLogprobs(9, -0.25, 1, ((9, -0.25), (4, -2.0)))
    msg = output_to_proto(GenerationOutput((9,), " hi", (logprob,)))
    assert (list(msg.token_ids), msg.text, msg.finish_reason) == ([9], " hi", "")
    assert not msg.HasField("usage") and not msg.HasField("timings")
    (entry,) = msg.logprobs
    assert (entry.token_id, entry.logprob, entry.rank) == (9, -0.25, 1)
    assert [(t.token_id, t.logprob) for t in entry.top] == [(9, -0.25), (4, -2.0)]


def test_the_last_output_carries_usage_and_timings():
    output = GenerationOutput((), "", (), "length", Usage(5, 3, 2), TIMINGS)
    msg = output_to_proto(output)
    assert msg.finish_reason == "length"
    assert (msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.cached_tokens) == (
        5,
        3,
        2,
    )
    as_sent = {f.name: getattr(msg.timings, f.name) for f in msg.timings.DESCRIPTOR.fields}
    assert as_sent == dataclasses.asdict(TIMINGS)
    # the dataclass lists the legs in generate.proto's order, so both APIs report them alike
    assert list(as_sent) == list(dataclasses.asdict(TIMINGS))
