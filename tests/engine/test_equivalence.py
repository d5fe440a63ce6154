"""Greedy output of `Engine` equals transformers on the same weights (docs/architecture.md rule)."""

from __future__ import annotations

import random

import pytest
import torch

from services.engine import SamplingParams
from tests.conftest import make_tiny_model
from tests.engine.helpers import GREEDY, make_engine, run_to_completion
from tests.reference import assert_equivalent, hf_greedy

PROMPT_LENS = [1, 15, 16, 17, 31, 32, 33, 100]


def _prompts(lens: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(n)] for n in lens]


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("max_tokens", [1, 32])
def test_tiny_models_alone(tiny_model, block_size, max_tokens):
    """Each prompt length alone, on llama and qwen2, for every block size."""
    engine = make_engine(tiny_model, block_size=block_size, num_blocks=4096 // block_size)
    for i, prompt in enumerate(_prompts(PROMPT_LENS, 512, seed=block_size)):
        outs, _ = run_to_completion(
            engine, {f"r{i}": (prompt, SamplingParams(max_tokens=max_tokens, **GREEDY))}
        )
        assert_equivalent(
            outs[f"r{i}"], hf_greedy(tiny_model, prompt, max_tokens), f"len={len(prompt)}"
        )


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_tiny_models_batched_mixed_lengths(tiny_model, block_size):
    """8 requests of mixed lengths and budgets run in one batch: each step really holds all 8."""
    engine = make_engine(tiny_model, block_size=block_size, num_blocks=4096 // block_size)
    prompts = _prompts(PROMPT_LENS, 512, seed=100 + block_size)
    budgets = [32, 7, 32, 12, 32, 3, 20, 32]
    requests = {
        f"r{i}": (p, SamplingParams(max_tokens=m, **GREEDY))
        for i, (p, m) in enumerate(zip(prompts, budgets, strict=True))
    }
    outs, steps = run_to_completion(engine, requests)
    batch_sizes = [len(step) for step in steps]
    assert batch_sizes[0] == 8 and batch_sizes[1] == 8, batch_sizes[:4]
    assert max(batch_sizes) == 8
    assert all(n == 1 for step in steps[1:] for n in step.values())  # decode: one token each
    for rid, (prompt, params) in requests.items():
        assert_equivalent(outs[rid], hf_greedy(tiny_model, prompt, params.max_tokens), rid)


@pytest.mark.parametrize("max_tokens", [1, 32])
def test_default_model(default_model, real_text_ids, max_tokens):
    """SmolLM2-135M-Instruct: every prompt length, all in one batch, against transformers."""
    engine = make_engine(default_model, num_blocks=256)
    prompts = [real_text_ids[1000 * i : 1000 * i + n] for i, n in enumerate(PROMPT_LENS)]
    requests = {
        f"r{n}": (p, SamplingParams(max_tokens=max_tokens, **GREEDY))
        for n, p in zip(PROMPT_LENS, prompts, strict=True)
    }
    outs, steps = run_to_completion(engine, requests)
    assert len(steps[0]) == len(PROMPT_LENS)
    for rid, (prompt, _) in requests.items():
        assert_equivalent(outs[rid], hf_greedy(default_model, prompt, max_tokens), rid)


def test_default_model_chunked_prefill(default_model, real_text_ids):
    """A prompt split into chunks by the token budget gives the same tokens."""
    engine = make_engine(default_model, num_blocks=256, max_num_batched_tokens=40)
    prompt = real_text_ids[500:600]
    outs, steps = run_to_completion(
        engine, {"r": (prompt, SamplingParams(max_tokens=16, **GREEDY))}
    )
    assert [step["r"] for step in steps[:4]] == [40, 40, 20, 1]
    assert engine.scheduler.num_prompt_tokens_computed == 100
    assert_equivalent(outs["r"], hf_greedy(default_model, prompt, 16), "chunked")


@pytest.mark.slow
@pytest.mark.parametrize("length", [1024, 4096])  # several chunks; half the context
def test_default_model_long_prompts(default_model, real_text_ids, length):
    """Prompt lengths that are multiples of block_size, on the real weights (the context's edge:
    `test_prompt_at_the_context_edge`, where the real model took a minute of the suite)."""
    engine = make_engine(default_model, kv_cache_memory_bytes=1 << 30)
    prompt = real_text_ids[:length]
    outs, _ = run_to_completion(engine, {"r": (prompt, SamplingParams(max_tokens=12, **GREEDY))})
    assert len(outs["r"]) == 12
    assert_equivalent(outs["r"], hf_greedy(default_model, prompt, 12), f"len={length}")


def test_prompt_at_the_context_edge(tmp_path):
    """An 8,160-token prompt decoded to the last of 8,192 positions (RoPE, block tables and
    the KV cache at the context's edge), on a tiny model with the default model's context."""
    model = str(make_tiny_model("llama", tmp_path / "edge", max_position_embeddings=8192))
    engine = make_engine(model, kv_cache_memory_bytes=64 << 20)
    prompt = [
        int(t) for t in torch.randint(2, 512, (8160,), generator=torch.Generator().manual_seed(5))
    ]
    outs, _ = run_to_completion(engine, {"r": (prompt, SamplingParams(max_tokens=32, **GREEDY))})
    assert len(outs["r"]) == 32 and engine.config.max_model_len == 8192
    assert_equivalent(outs["r"], hf_greedy(model, prompt, 32), "len=8160")


def test_prefill_joins_running_decodes(tiny_model):
    """A step that mixes decodes of running requests with a new prompt's prefill stays exact."""
    engine = make_engine(tiny_model, num_blocks=256)
    first, late = _prompts([20, 45], 512, seed=9)
    engine.add_request(first, SamplingParams(max_tokens=24, **GREEDY), request_id="first")
    outs = {}
    for _ in range(5):
        engine.step()
    engine.add_request(late, SamplingParams(max_tokens=16, **GREEDY), request_id="late")
    mixed_steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.output_token_ids
        mixed_steps += engine.last_forward_tokens == {"first": 1, "late": 45}
        engine.check_integrity()
    assert mixed_steps == 1
    assert_equivalent(outs["first"], hf_greedy(tiny_model, first, 24), "first")
    assert_equivalent(outs["late"], hf_greedy(tiny_model, late, 16), "late")


def test_the_reference_answers_a_shorter_ask_for_a_known_prompt_as_a_fresh_run_would(tiny_llama):
    """tests/reference.py remembers each greedy reference; a later, shorter ask for the same
    prompt gets the remembered prefix, equal to what a fresh run (processors bypass the memory)
    computes."""
    prompt = [5, 6, 7, 8, 9]
    longer = hf_greedy(tiny_llama, prompt, 6)
    remembered = hf_greedy(tiny_llama, prompt, 3)
    fresh = hf_greedy(tiny_llama, prompt, 3, processors=lambda ids, logits: logits)
    assert remembered.token_ids == fresh.token_ids == longer.token_ids[:3]
    assert remembered.top2_gaps == fresh.top2_gaps
