"""Greedy output with logit bias and penalties equals a transformers greedy loop with reference
logits processors (docs/architecture.md equivalence rule), in one engine and across the P/D
split."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from services.engine import SamplingParams
from tests.engine.helpers import GREEDY, make_engine, run_to_completion
from tests.engine.test_disaggregated import _disaggregated, _pair
from tests.reference import Reference, assert_equivalent, hf_greedy

MAX_TOKENS = 24
PROMPT_LENS = [5, 17, 40]


class OutputPenalties(LogitsProcessor):
    """OpenAI's frequency and presence penalties over the generated tokens only (vLLM's
    definition): minus frequency * count, then minus presence if the count is > 0."""

    def __init__(self, num_prompt_tokens: int, frequency: float, presence: float) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.frequency = frequency
        self.presence = presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        generated = input_ids[0, self.num_prompt_tokens :].tolist()
        for token in set(generated):
            scores[0, token] -= self.frequency * generated.count(token)
            scores[0, token] -= self.presence
        return scores


def _cases(plain: list[int]) -> dict[str, dict]:
    """Each penalty alone and all of them together; the bias bans the first two tokens the
    model picks without it and favours another token."""
    bias = {plain[0]: -100.0, plain[1]: -100.0, 7: 2.0}
    return {
        "repetition": dict(repetition_penalty=2.0),
        "presence": dict(presence_penalty=2.0),
        "frequency": dict(frequency_penalty=1.5),
        "logit_bias": dict(logit_bias=bias),
        "combined": dict(
            logit_bias=bias, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.5
        ),
    }


def _reference_processors(params: SamplingParams, num_prompt_tokens: int) -> LogitsProcessorList:
    """transformers' processors in vLLM's order: bias, repetition, frequency, presence."""
    processors = LogitsProcessorList()
    if params.logit_bias:
        processors.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in params.logit_bias]))
    if params.repetition_penalty != 1.0:  # penalises prompt + generated tokens, as vLLM does
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.frequency_penalty or params.presence_penalty:
        processors.append(
            OutputPenalties(num_prompt_tokens, params.frequency_penalty, params.presence_penalty)
        )
    return processors


def _requests(model: str) -> tuple[dict, dict[str, Reference]]:
    """{request_id: (prompt, params)} with a plain request per prompt, and the references."""
    rng = random.Random(5)
    requests, refs = {}, {}
    for n in PROMPT_LENS:
        prompt = [rng.randrange(2, 512) for _ in range(n)]
        refs[f"{n}-plain"] = plain = hf_greedy(model, prompt, MAX_TOKENS)
        requests[f"{n}-plain"] = (prompt, SamplingParams(max_tokens=MAX_TOKENS, **GREEDY))
        for name, kwargs in _cases(plain.token_ids).items():
            params = SamplingParams(max_tokens=MAX_TOKENS, **GREEDY, **kwargs)
            requests[f"{n}-{name}"] = (prompt, params)
            refs[f"{n}-{name}"] = hf_greedy(
                model, prompt, MAX_TOKENS, _reference_processors(params, len(prompt))
            )
    return requests, refs


@pytest.fixture(scope="module")
def penalised(tiny_model):
    """The requests, their references and their outputs from one BOTH engine, all in a batch."""
    requests, refs = _requests(tiny_model)
    outs, steps = run_to_completion(make_engine(tiny_model, num_blocks=512), requests)
    assert len(steps[0]) == len(requests)  # plain and penalised rows share every step
    return requests, refs, outs


def test_greedy_with_penalties_equals_transformers(penalised):
    requests, refs, outs = penalised
    for rid in requests:
        assert_equivalent(outs[rid], refs[rid], rid)
        if not rid.endswith("-plain"):
            plain = refs[rid.split("-")[0] + "-plain"].token_ids
            assert outs[rid] != plain, f"{rid}: the penalty changed nothing"


def test_prefill_and_decode_engines_give_the_same_tokens(tiny_model, penalised):
    """The PREFILL engine samples the first token (prompt history only), the DECODE engine the
    rest (prompt + every output, the first included): the split changes no token."""
    requests, _, outs = penalised
    requests = dict(requests)
    sampled = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.9, seed=4, repetition_penalty=1.3, presence_penalty=1.0
    )
    requests["sampled"] = ([9, 8, 7, 9, 8, 7], sampled)
    both, _ = run_to_completion(
        make_engine(tiny_model, num_blocks=512), {"sampled": requests["sampled"]}
    )
    prefill, decode, _ = _pair(tiny_model)
    split, _, _ = _disaggregated(prefill, decode, requests)
    assert split == {**outs, **both}
