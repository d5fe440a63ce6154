"""Greedy output on the GPU equals transformers' by docs/architecture.md's rule: in bf16 (at
the first divergence each side's token is in the other's top 5) with the backend `auto` picks
(triton, or flash_attn where installed), and in float32 (token ids equal up to a tie of the
reference's top two logits, `tests/reference.py`; the ties gate of tests/conftest.py counts these
cases) with Triton, whose float32 dots are IEEE, not TF32."""

from __future__ import annotations

from tests import reference
from tests.gpu.models import (
    GPU,
    MAX_TOKENS,
    PROMPTS,
    assert_close_bf16,
    engine_greedy,
    engine_llm,
    hf_greedy_top5,
    small_llama,
)

pytestmark = GPU


def test_greedy_equals_transformers_in_bf16() -> None:
    path = small_llama()
    llm = engine_llm(path, attention_backend="auto")
    backend = llm.engine.model.attention.name
    assert backend in ("triton", "flash_attn"), backend
    ours = engine_greedy(llm)
    steps = [
        assert_close_bf16(got, hf_greedy_top5(path, prompt), f"{backend}, prompt of {len(prompt)}")
        for prompt, got in zip(PROMPTS, ours, strict=True)
    ]
    print(f"  bf16 ({backend}): first divergence per prompt {steps} of {MAX_TOKENS} tokens")


def test_greedy_equals_transformers_in_float32() -> None:
    path = small_llama()
    llm = engine_llm(path, dtype="float32", attention_backend="triton")
    ours = engine_greedy(llm)
    for prompt, (tokens, _) in zip(PROMPTS, ours, strict=True):
        ref = reference.hf_greedy(path, prompt, MAX_TOKENS)  # transformers on the CPU, float32
        verdict = reference.assert_equivalent(tokens, ref, f"float32, prompt of {len(prompt)}")
        print(f"  float32 prompt of {len(prompt)}: tie at {verdict.tie_step}")
