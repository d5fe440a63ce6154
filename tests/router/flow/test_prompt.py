"""Request validation and tokenization (services/router/flow/prompt.py): bad sampling and bad
prompts name the field; text and chat prompts tokenize like the model's tokenizer."""

from __future__ import annotations

import time

import pytest

from services.engine.errors import InvalidRequestError
from services.engine.sampling_params import SamplingParams
from services.router.flow.messages import ChatMessage, GenerationRequest
from services.router.flow.prompt import ModelInfo, PreparedRequest, prepare_request
from tests.router.fakes import PROMPT, _flow_request


@pytest.mark.parametrize(
    "sampling, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ],
)
def test_bad_sampling_names_the_field(model_info, sampling, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        prepare_request(_flow_request(**sampling), model_info)


def test_bad_prompts_name_the_field(model_info):
    """Checked when the request is built (no prompt, two prompts) or prepared (the rest)."""
    cases = [
        ({}, "prompt"),
        ({"text": "a", "token_ids": (1,)}, "prompt"),
        ({"text": ""}, "prompt"),
        ({"token_ids": ()}, "prompt"),
        ({"token_ids": (5, model_info.vocab_size)}, "prompt_token_ids"),
        ({"token_ids": (-1,)}, "prompt_token_ids"),
        ({"chat": ()}, "prompt"),
        ({"chat": (ChatMessage("robot", "x"),)}, r"chat\.messages\[0\]\.role"),
    ]
    for fields, field in cases:
        with pytest.raises(InvalidRequestError, match=f"^{field}:"):
            prepare_request(GenerationRequest(**fields), model_info)


def _ids_request(ids: list[int], max_tokens: int) -> GenerationRequest:
    return GenerationRequest(token_ids=tuple(ids), sampling=SamplingParams(max_tokens=max_tokens))


def test_prompt_at_max_model_len_is_refused(model_info):
    short = ModelInfo.load(str(model_info.path), max_model_len=4)
    with pytest.raises(InvalidRequestError, match="^prompt:.*max_model_len 4"):
        prepare_request(_ids_request([1, 2, 3, 4], 1), short)
    assert prepare_request(_ids_request([1, 2, 3], 1), short)


def test_prompt_plus_max_tokens_over_max_model_len_is_refused_up_front(model_info):
    """vLLM's rule: prompt + max_tokens must fit max_model_len (400, never a 429 to retry)."""
    short = ModelInfo.load(str(model_info.path), max_model_len=8)
    with pytest.raises(InvalidRequestError, match=r"^max_tokens: prompt \(3 tokens\) \+ max"):
        prepare_request(_ids_request([1, 2, 3], 6), short)
    assert prepare_request(_ids_request([1, 2, 3], 5), short)
    with pytest.raises(InvalidRequestError, match="^max_tokens: must be below max_model_len 8"):
        prepare_request(_ids_request([1], 10**9), short)


def test_a_text_far_too_long_is_refused_without_tokenizing(model_info, monkeypatch):
    """15 MB of text cannot be under max_model_len tokens: refused in constant time."""
    assert model_info.tokenizer is not None
    monkeypatch.setattr(model_info.tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized"))
    request = GenerationRequest(text="x" * 15_000_000)
    with pytest.raises(InvalidRequestError, match="^prompt: 15000000 characters are at least"):
        prepare_request(request, model_info)
    chat = GenerationRequest(chat=(ChatMessage("user", "y" * 15_000_000),))
    with pytest.raises(InvalidRequestError, match="^messages: "):
        prepare_request(chat, model_info)


def test_text_and_chat_tokenize_like_the_tokenizer(model_info):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_info.path)
    prepared = prepare_request(_flow_request(max_tokens=3), model_info)
    assert prepared.prompt_token_ids == tok.encode(PROMPT, add_special_tokens=False)
    assert prepared.params.max_tokens == 3 and prepared.request_id
    messages = [{"role": "user", "content": "hi"}]
    chat = GenerationRequest(chat=tuple(ChatMessage(**m) for m in messages))
    expected = tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    assert prepare_request(chat, model_info).prompt_token_ids == expected


def test_what_is_left_of_the_ttft_objective_goes_to_a_local_prefill_only():
    """The decode worker prefilling a prompt is sent the milliseconds left of its TTFT objective
    (its own, else the router's --slo-ttft-ms) since its path was chosen; the remote path, a
    request without an objective and one already past it send 0 (none)."""
    params = SamplingParams(max_tokens=4)
    request = PreparedRequest("r", [1, 2, 3], params, (), ttft_objective_ms=500)
    chosen = time.monotonic() - 0.2
    assert 250 < request.ttft_left_ms(chosen, None, local=True) <= 300
    assert request.ttft_left_ms(chosen, None, local=False) == 0.0
    assert request.ttft_left_ms(time.monotonic() - 1.0, None, local=True) == 0.0
    none = PreparedRequest("r", [1, 2, 3], params, ())
    assert none.ttft_left_ms(chosen, None, local=True) == 0.0
    assert 750 < none.ttft_left_ms(chosen, 1000.0, local=True) <= 800
    assert request.path_objectives() == (500, 0.0, 0.0)
