"""The equivalence rule of docs/architecture.md, applied after a benchmark run.

A benchmark decodes many requests greedily in pdserve and in transformers; where two outputs
first differ, both sides' distributions at that position are recomputed for that one sequence
(transformers' forward, and a one-token pdserve request with logprobs) and the rule decides:
- float32: the reference is transformers' forward on that one sequence; a divergence is allowed
  when pdserve's token is the reference's (transformers' batched `generate` drifted, not pdserve)
  or when the reference's top-2 logits differ by < 1e-3 (a tie);
- bfloat16 / float16: each side's token must be among the other side's top-5 (vLLM's
  `check_logprobs_close`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine import LLM, Engine, SamplingParams

TIE_GAP = 1e-3
TOP_K = 5


@dataclass(frozen=True)
class Verdict:
    """How one request's pdserve output compares with the reference."""

    equal: bool  # identical token ids
    step: int | None  # first differing step, None if equal
    allowed: bool  # equal, or the divergence is allowed by the rule
    detail: str


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    for step, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return step
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


@torch.inference_mode()
def judge(
    engine: Engine, hf_model, dtype: str, prompt: list[int], ours: list[int], theirs: list[int]
) -> Verdict:
    """Apply the rule to one request; `hf_model` is transformers' model in the run's dtype."""
    step = first_divergence(ours, theirs)
    if step is None:
        return Verdict(True, None, True, "equal")
    if step >= min(len(ours), len(theirs)):
        return Verdict(False, step, False, f"lengths differ ({len(ours)} vs {len(theirs)})")
    context = prompt + ours[:step]
    logits = hf_model(input_ids=torch.tensor([context]), logits_to_keep=1).logits[0, -1].float()
    if dtype == "float32":
        top2 = logits.topk(2).values
        gap = float(top2[0] - top2[1])
        if ours[step] == int(logits.argmax()):  # transformers' batched run left the reference
            return Verdict(
                False,
                step,
                True,
                f"step {step}: pdserve has the reference token; transformers' batch diverged",
            )
        return Verdict(False, step, gap < TIE_GAP, f"step {step}: reference top-2 gap {gap:.1e}")
    ref_top = set(logits.topk(TOP_K).indices.tolist())
    [out] = LLM(engine).generate(
        [context], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=TOP_K)
    )
    our_top = {token_id for token_id, _ in out.logprobs[0].top}
    allowed = ours[step] in ref_top and theirs[step] in our_top
    return Verdict(
        False, step, allowed, f"step {step}: each token in the other's top-{TOP_K}: {allowed}"
    )
