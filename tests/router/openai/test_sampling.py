"""OpenAI's sampling fields (services/router/openai/sampling.py) become SamplingParams, which
checks every value: each bad field is named as the client sent it (max_completion_tokens,
top_logprobs), and only OpenAI's shapes are checked here."""

from __future__ import annotations

import pytest

from services.engine.errors import InvalidRequestError
from services.engine.sampling_params import SamplingParams
from services.router.openai.sampling import sampling_from_body, stop_strings


def test_every_field_reaches_the_params():
    body = {
        "max_tokens": 9,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 4,
        "seed": 2**64 - 1,
        "ignore_eos": True,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.5,
        "logit_bias": {"17": -100, "3": 2.5},
        "logprobs": 2,
    }
    assert sampling_from_body(body, chat=False) == SamplingParams(
        max_tokens=9,
        temperature=0.5,
        top_p=0.9,
        top_k=4,
        seed=2**64 - 1,
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.5,
        logit_bias={17: -100.0, 3: 2.5},
        logprobs=2,
    )
    nulls = dict.fromkeys(body)
    assert sampling_from_body(nulls, chat=False) == SamplingParams()  # null: the default


def test_chat_names():
    body = {"max_tokens": 30, "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 3}
    assert sampling_from_body(body, chat=True) == SamplingParams(max_tokens=7, logprobs=3)
    assert sampling_from_body({"logprobs": True}, chat=True).logprobs == 0
    assert sampling_from_body({"logprobs": False}, chat=True).logprobs is None


@pytest.mark.parametrize(
    "body, chat, field",
    [
        ({"max_tokens": -1}, False, "max_tokens"),
        ({"max_tokens": 2**31}, False, "max_tokens"),
        ({"max_completion_tokens": 0}, True, "max_completion_tokens"),
        ({"temperature": "hot"}, False, "temperature"),
        ({"top_p": 0}, False, "top_p"),
        ({"top_k": 2**40}, False, "top_k"),
        ({"seed": -5}, False, "seed"),
        ({"seed": 2**64}, False, "seed"),
        ({"ignore_eos": "yes"}, False, "ignore_eos"),
        ({"presence_penalty": 3}, False, "presence_penalty"),
        ({"frequency_penalty": [1]}, False, "frequency_penalty"),
        ({"repetition_penalty": 0}, False, "repetition_penalty"),
        ({"logit_bias": {"5": 200}}, False, "logit_bias"),
        ({"logit_bias": {"5": "x"}}, False, "logit_bias"),
        ({"logit_bias": {"x": 1}}, False, "logit_bias"),
        ({"logit_bias": [1]}, False, "logit_bias"),
        ({"logit_bias": {"9999999999": 1}}, False, "logit_bias"),
        ({"logprobs": 21}, False, "logprobs"),
        ({"logprobs": True}, False, "logprobs"),
        ({"logprobs": 1}, True, "logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, True, "top_logprobs"),
        ({"top_logprobs": 2}, True, "top_logprobs"),
    ],
)
def test_a_bad_field_is_named_as_sent(body, chat, field):
    with pytest.raises(InvalidRequestError, match=f"^{field}:") as info:
        sampling_from_body(body, chat)
    assert info.value.field == field


def test_stop_is_a_string_or_a_list_of_strings():
    assert stop_strings({}) == () and stop_strings({"stop": None}) == ()
    assert stop_strings({"stop": "x"}) == ("x",)
    assert stop_strings({"stop": ["a", "b"]}) == ("a", "b")
    with pytest.raises(InvalidRequestError, match="^stop: must be a string or a list"):
        stop_strings({"stop": 5})
    with pytest.raises(InvalidRequestError, match=r"^stop\[1\]: must be a string"):
        stop_strings({"stop": ["a", 5]})
    with pytest.raises(InvalidRequestError, match="^stop: contains a lone UTF-16 surrogate"):
        stop_strings({"stop": "a\ud800"})
