"""Log-probabilities of sampled tokens and their top alternatives, against transformers."""

from __future__ import annotations

import pytest
import torch

from services.engine import LLM, SamplingParams
from tests.engine.helpers import GREEDY, make_engine, run_to_completion
from tests.reference import hf_model


def _reference_logprobs(path: str, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each generated position: [len(tokens), vocab_size]."""
    with torch.inference_mode():
        logits = hf_model(path)(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)], dim=-1)


def _run(path: str, prompt: list[int], params: SamplingParams):
    engine = make_engine(path)
    engine.add_request(prompt, params, request_id="r")
    tokens, logprobs = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += out.new_logprobs
    return tokens, logprobs


def test_greedy_logprobs_and_top_alternatives_match_transformers(default_model, real_text_ids):
    prompt = real_text_ids[100:140]
    tokens, logprobs = _run(
        default_model, prompt, SamplingParams(max_tokens=12, logprobs=5, **GREEDY)
    )
    reference = _reference_logprobs(default_model, prompt, tokens)
    assert len(logprobs) == len(tokens) == 12
    for step, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        assert lp.token_id == token and lp.rank == 1
        assert lp.logprob == pytest.approx(float(reference[step, token]), abs=1e-4)
        assert len(lp.top) == 5 and lp.top[0][0] == token
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        ref_top = reference[step].topk(5)
        torch.testing.assert_close(
            torch.tensor([v for _, v in lp.top]), ref_top.values, atol=1e-4, rtol=0
        )


def test_sampled_tokens_report_the_raw_distribution_and_their_rank(default_model, real_text_ids):
    prompt = real_text_ids[300:330]
    params = SamplingParams(max_tokens=16, temperature=1.5, seed=3, ignore_eos=True, logprobs=0)
    tokens, logprobs = _run(default_model, prompt, params)
    reference = _reference_logprobs(default_model, prompt, tokens)
    for step, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        assert lp.top == ()  # logprobs=0: the sampled token only
        assert lp.logprob == pytest.approx(float(reference[step, token]), abs=1e-4)  # not tempered
        assert lp.rank == int((reference[step] > reference[step, token]).sum()) + 1
    assert any(lp.rank > 1 for lp in logprobs)  # at temperature 1.5 some token is not the argmax


def test_no_logprobs_unless_asked(tiny_llama):
    outs, _ = run_to_completion(
        make_engine(tiny_llama), {"r": ([3, 4, 5], SamplingParams(max_tokens=4, **GREEDY))}
    )
    engine = make_engine(tiny_llama)
    [out] = LLM(engine).generate([[3, 4, 5]], SamplingParams(max_tokens=4, **GREEDY))
    assert out.logprobs == () and out.token_ids == outs["r"]
    [out] = LLM(engine).generate([[3, 4, 5]], SamplingParams(max_tokens=4, logprobs=2, **GREEDY))
    assert [lp.token_id for lp in out.logprobs] == outs["r"]


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_logprobs_out_of_range_names_the_field(value):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=value)
