"""Blocked bfloat16 prefill attention (`blocked_prefill.py`, the `cpu_paged` backend's prefill on
CPUs without AMX) against torch SDPA: alone, with and without the C++ causal softmax, over the
paged cache inside the backend, and a whole engine's greedy output against transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.engine.attention import TorchSDPABackend, blocked_prefill, get_attention_backend
from services.engine.attention.self_test import TOLERANCE, random_step
from services.engine.kernels import load_cpu_kernels

needs_kernels = pytest.mark.skipif(load_cpu_kernels() is None, reason="no C++ compiler here")


def _reference(q, k, v, scale):
    """SDPA in float32 with an explicit mask: the last q.shape[0] positions over all keys."""
    num_queries, num_keys = q.shape[0], k.shape[0]
    positions = torch.arange(num_keys - num_queries, num_keys)
    mask = torch.arange(num_keys)[None, :] <= positions[:, None]
    q, k, v = (t.float().transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("num_queries", "num_keys"), [(1, 1), (7, 7), (300, 300), (40, 300), (1, 90), (513, 600)]
)
def test_blocked_attention_matches_sdpa(monkeypatch, kernel, dtype, num_queries, num_keys):
    """Fresh prompts (queries == keys) and chunks after a cached prefix, across block edges
    (BLOCK_ROWS 256) and GQA groups of 3, within the self-test's tolerance for the dtype."""
    if kernel and load_cpu_kernels() is None:
        pytest.skip("no C++ compiler here")
    if not kernel:
        monkeypatch.setattr(blocked_prefill, "load_cpu_kernels", lambda: None)
    gen = torch.Generator().manual_seed(num_queries * 1000 + num_keys)
    q = torch.randn(num_queries, 6, 32, generator=gen).to(dtype)
    k, v = (torch.randn(num_keys, 2, 32, generator=gen).to(dtype) for _ in range(2))
    got = blocked_prefill.causal_attention(q, k, v, 32**-0.5)
    assert got.shape == q.shape and got.dtype == dtype
    assert (got.float() - _reference(q, k, v, 32**-0.5)).abs().max() <= TOLERANCE[dtype]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_causal_softmax_kernel_is_torch_softmax_of_the_masked_scores(dtype):
    """Each row: float32 softmax of scale * scores over the keys up to its position, rounded
    once to the dtype (transformers' eager attention), exact zeros after it."""
    scores = torch.randn(2, 5, 3, 9).mul(4).to(dtype)  # [kv_heads, rows, group, keys]
    first = 4  # row r sits at position 4 + r
    want = scores.float().mul(0.7)
    future = torch.arange(9)[None, :] > (first + torch.arange(5))[:, None]  # [rows, keys]
    want = torch.softmax(want.masked_fill(future[None, :, None, :], float("-inf")), -1).to(dtype)
    got = scores.clone()
    load_cpu_kernels().causal_softmax(got, 0.7, first)
    assert (got.float() - want.float()).abs().max() <= (1e-6 if dtype == torch.float32 else 4e-3)
    assert (got[..., 8:][:, :4] == 0).all()  # rows 0-3 (positions 4-7) never see key 8


def test_blocked_attention_names_bad_shapes():
    q = torch.randn(5, 6, 8)
    with pytest.raises(ValueError, match=r"^causal_attention: q \(5, 6, 8\) against k \(4, 2, 8\)"):
        blocked_prefill.causal_attention(q, torch.randn(4, 2, 8), torch.randn(4, 2, 8), 1.0)
    with pytest.raises(ValueError, match="causal_attention"):  # 6 heads over 4 KV heads
        blocked_prefill.causal_attention(q, torch.randn(5, 4, 8), torch.randn(5, 4, 8), 1.0)


@needs_kernels
@pytest.mark.parametrize("requests", [[(0, 7), (0, 7), (0, 20), (5, 12), (17, 1), (40, 1)],
                                      [(0, 300), (260, 40), (511, 1), (2, 1)]])  # fmt: skip
def test_cpu_paged_blocked_prefill_matches_sdpa_over_the_paged_cache(requests):
    """The backend with blocked prefill forced on (as on a CPU without AMX) against the SDPA
    reference over one paged step: fresh prompts grouped by length, chunks after a cached
    prefix, decodes beside them."""
    step = random_step(requests, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                       dtype=torch.bfloat16, device="cpu", seed=3)  # fmt: skip
    backend = get_attention_backend("cpu_paged", "cpu", 16)
    backend.blocked = True
    outputs = []
    for b in (TorchSDPABackend(), backend):
        k_cache, v_cache = step.clone_caches()
        outputs.append(b.forward(step.query, step.key, step.value, k_cache, v_cache, step.meta,
                                 64**-0.5))  # fmt: skip
    want, got = outputs
    assert got.shape == want.shape and got.isfinite().all()
    assert (got.float() - want.float()).abs().max() <= TOLERANCE[torch.bfloat16]


@needs_kernels
def test_an_engine_with_blocked_prefill_decodes_as_with_sdpa(monkeypatch, tiny_model):
    """Greedy bfloat16 output of a whole engine (fresh prompts of two lengths in one step,
    chunked prefill after a cached prefix, batched decode) with blocked prefill on and off, by
    the bfloat16 equivalence rule: equal up to the first divergence, where each side's token is
    among the other's top 5."""
    from services.engine import SamplingParams
    from services.engine.attention import cpu_paged
    from tests.engine.helpers import make_engine

    params = SamplingParams(max_tokens=12, logprobs=5, temperature=0.0, ignore_eos=True)
    prompts = {"a": list(range(3, 40)), "b": list(range(100, 105)), "c": [7] * 70}
    runs = []
    for blocked in (True, False):
        monkeypatch.setattr(cpu_paged, "has_amx", lambda blocked=blocked: not blocked)
        engine = make_engine(tiny_model, dtype="bfloat16", num_blocks=256,
                             attention_backend="cpu_paged", max_num_batched_tokens=48)  # fmt: skip
        assert engine.runner.model.attention.blocked is blocked
        for rid, prompt in prompts.items():
            engine.add_request(prompt, params, request_id=rid)
        outs: dict[str, list] = {rid: [] for rid in prompts}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs[out.request_id].extend(out.new_logprobs)
        runs.append(outs)
    for rid in prompts:
        got, want = runs[0][rid], runs[1][rid]
        assert len(got) == len(want) == 12
        for a, b in zip(got, want, strict=True):
            if a.token_id != b.token_id:
                assert a.token_id in dict(b.top) and b.token_id in dict(a.top), rid
                break
