"""The Hugging Face transformers reference and the equivalence rule of docs/architecture.md.

float32 rule: token ids must be equal, except that a divergence at a step where the reference's
top-2 logits differ by less than 1e-3 is a tie (both choices are right) and the comparison ends
there. Every comparison is recorded; conftest fails the session when more than 10% of cases end
at a tie before half their tokens (the suite would be inconclusive).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

TIE_GAP = 1e-3


@dataclass(frozen=True)
class Reference:
    token_ids: list[int]
    top2_gaps: list[float]  # reference logit gap between its best and second-best token, per step


@dataclass(frozen=True)
class Verdict:
    num_tokens: int
    tie_step: int | None  # step where a tie ended the comparison, else None


VERDICTS: list[Verdict] = []


# The longest greedy reference computed this session per (model path, prompt): the suite asks
# for the same prompts in several tests, and each reference token costs a transformers forward.
_GREEDY: dict[tuple[str, tuple[int, ...]], Reference] = {}


@functools.lru_cache(maxsize=4)
def hf_model(path: str, dtype: torch.dtype = torch.float32):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


@torch.inference_mode()
def hf_greedy(
    path: str,
    prompt_ids: list[int],
    max_tokens: int,
    processors: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> Reference:
    """Greedy decoding with transformers' own forward and KV cache (no EOS stop).

    `processors` (e.g. a transformers `LogitsProcessorList`) turns (input_ids [1, num_tokens]:
    prompt + generated so far, logits [1, vocab_size]) into the logits the argmax picks from.
    Without processors the reference is remembered for the session: a later call for the same
    model and prompt with at most as many tokens returns its prefix without a forward.
    """
    if processors is None:  # greedy is deterministic: a longer run's prefix is the shorter run
        known = _GREEDY.get((path, tuple(prompt_ids)))
        if known is not None and len(known.token_ids) >= max_tokens:
            return Reference(known.token_ids[:max_tokens], known.top2_gaps[:max_tokens])
    model = hf_model(path)
    tokens: list[int] = []
    gaps = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True, logits_to_keep=1)
        for _ in range(max_tokens):
            logits = out.logits[0, -1].float()
            if processors is not None:
                logits = processors(torch.tensor([prompt_ids + tokens]), logits[None])[0]
            top2 = logits.topk(2).values
            gaps.append(float(top2[0] - top2[1]))
            tokens.append(int(logits.argmax()))
            out = model(
                input_ids=torch.tensor([[tokens[-1]]]),
                past_key_values=out.past_key_values,
                use_cache=True,
                logits_to_keep=1,
            )
    reference = Reference(tokens, gaps)
    if processors is None:
        _GREEDY[(path, tuple(prompt_ids))] = reference
    return reference


def assert_equivalent(actual: list[int], ref: Reference, context: str = "") -> Verdict:
    """Apply the float32 equivalence rule; raises AssertionError on a real divergence."""
    for step, (got, want) in enumerate(zip(actual, ref.token_ids, strict=False)):
        if got != want:
            if ref.top2_gaps[step] < TIE_GAP:
                verdict = Verdict(len(ref.token_ids), step)
                VERDICTS.append(verdict)
                return verdict
            raise AssertionError(
                f"{context}: diverged at step {step}: got {got}, reference {want} "
                f"(reference top-2 gap {ref.top2_gaps[step]:.2e})\n got: {actual}\n "
                f"ref: {ref.token_ids}"
            )
    assert len(actual) == len(ref.token_ids), (
        f"{context}: {len(actual)} tokens, reference {len(ref.token_ids)}"
    )
    verdict = Verdict(len(ref.token_ids), None)
    VERDICTS.append(verdict)
    return verdict


def inconclusive_ratio() -> tuple[int, int]:
    """(cases ending at a tie before half their tokens, all cases)."""
    early = sum(1 for v in VERDICTS if v.tie_step is not None and v.tie_step < v.num_tokens / 2)
    return early, len(VERDICTS)
