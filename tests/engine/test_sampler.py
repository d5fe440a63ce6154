"""Sampling: greedy, temperature, top-k, top-p, and seeds independent of batch neighbours."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine import SamplingParams
from services.engine.sampler import SamplingRow, sample
from tests.engine.helpers import GREEDY, make_engine, run_to_completion


def _row(seed=0, index=0, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), seed, index)


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 4.9, 0.0]])
    assert sample(logits, [_row(temperature=0), _row(temperature=0)])[0] == [1, 0]


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    greedy = logits.argmax(-1).tolist()
    assert sample(logits, [_row(seed=s, top_k=1) for s in range(4)])[0] == greedy
    assert sample(logits, [_row(seed=s, top_p=1e-6) for s in range(4)])[0] == greedy


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**40), top_k=st.integers(1, 20), top_p=st.floats(0.05, 1.0))
def test_sampled_token_is_inside_top_k_and_nucleus(seed, top_k, top_p):
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(seed % 1000))
    (token,), _ = sample(logits, [_row(seed=seed, top_k=top_k, top_p=top_p, temperature=0.7)])
    ranked = logits[0].argsort(descending=True).tolist()
    assert ranked.index(token) < top_k
    probs = torch.softmax(logits[0] / 0.7, -1)[ranked]
    mass_before = float(probs[: ranked.index(token)].sum())
    assert mass_before < top_p + 1e-6


def test_temperature_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    counts = torch.zeros(3)
    for seed in range(3000):
        counts[sample(logits, [_row(seed=seed)])[0][0]] += 1
    assert torch.allclose(counts / 3000, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_same_seed_same_tokens_whoever_the_neighbours(tiny_llama):
    """A seeded sampled request gives the same tokens alone and in a batch of 8 mixed requests."""
    target = ([9, 8, 7, 6], SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=42))
    alone, _ = run_to_completion(make_engine(tiny_llama, num_blocks=256), {"t": target})
    batch = {"t": target}
    for i in range(7):
        params = (
            SamplingParams(max_tokens=5 + i, **GREEDY)
            if i % 2
            else SamplingParams(max_tokens=9, seed=i)
        )
        batch[f"n{i}"] = (list(range(2, 4 + 5 * i)), params)
    together, steps = run_to_completion(make_engine(tiny_llama, num_blocks=256), batch)
    assert len(steps[0]) == 8
    assert together["t"] == alone["t"]
    other_seed, _ = run_to_completion(
        make_engine(tiny_llama, num_blocks=256),
        {"t": (target[0], SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=43))},
    )
    assert other_seed["t"] != alone["t"]
