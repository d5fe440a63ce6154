"""Every attention backend against torch SDPA over the same paged cache, on the CPU: the Triton
kernel in Triton's interpreter, FlexAttention eagerly, for block sizes 16 and 256; flash-attn's
layout (block tables, cu_seqlens, slot mappings) through a torch model of its documented
semantics; the start-up self-test refusing a backend that returns zeros; the registry's errors.
(tests/conftest.py sets TRITON_INTERPRET=1 before Triton loads.)
"""

from __future__ import annotations

import pytest
import torch

from services.engine.attention import (
    AttentionBackend,
    TorchSDPABackend,
    get_attention_backend,
    resolve_backend_name,
)
from services.engine.attention.flash import (
    check_flash_block_size,
    flash_layout,
)
from services.engine.attention.self_test import (
    TOLERANCE,
    AttentionSelfTestError,
    random_step,
    self_test,
)

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

# (cached tokens, new tokens) per request: fresh prompts of two lengths, chunks after a cached
# prefix (one crossing a block boundary), decodes at, past and well past a block boundary.
MIXED = [(0, 7), (0, 7), (0, 20), (5, 12), (17, 1), (16, 1), (40, 1), (3, 1)]
LONG = [(0, 300), (260, 40), (511, 1), (255, 1), (2, 1)]  # spans several 256-token blocks


def _compare(name, requests, block_size, dtype, num_heads=8, num_kv_heads=2, head_dim=64):
    step = random_step(
        requests,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device="cpu",
        seed=block_size,
    )
    scale = head_dim**-0.5
    outputs, caches = [], []
    for backend in (TorchSDPABackend(), get_attention_backend(name, "cpu", block_size)):
        k_cache, v_cache = step.clone_caches()
        outputs.append(
            backend.forward(step.query, step.key, step.value, k_cache, v_cache, step.meta, scale)
        )
        caches.append((k_cache, v_cache))
    want, got = outputs
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.isfinite().all()
    assert (got.float() - want.float()).abs().max() <= TOLERANCE[dtype]
    for (k_ref, v_ref), (k, v) in zip(caches[:1], caches[1:], strict=True):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)  # the same cache write


needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton does not install here")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "requests"), [(16, MIXED), (256, LONG), (256, MIXED)])
def test_triton_kernel_matches_sdpa_over_the_paged_cache(block_size, requests, dtype):
    _compare("triton", requests, block_size, dtype)


@needs_triton
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 48), (8, 1, 128)]
)
def test_triton_kernel_handles_gqa_groups_and_odd_head_dims(num_heads, num_kv_heads, head_dim):
    _compare("triton", MIXED, 16, torch.float32, num_heads, num_kv_heads, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "requests"), [(16, MIXED), (256, LONG)])
def test_flex_attention_matches_sdpa_over_the_paged_cache(block_size, requests, dtype):
    _compare("flex", requests, block_size, dtype)


def test_flex_attention_serves_a_block_shared_by_two_requests():
    """Prefix caching: two requests hold the same physical first block at logical index 0."""
    step = random_step([(16, 1), (20, 1)], num_heads=4, num_kv_heads=2, head_dim=32,
                       block_size=16, dtype=torch.float32, device="cpu")  # fmt: skip
    tables = step.meta.decode_block_tables.clone()
    tables[1, 0] = tables[0, 0]  # request 1 reads request 0's first block as its own
    meta = type(step.meta)(
        slot_mapping=step.meta.slot_mapping,
        prefills=(),
        num_prefill_tokens=0,
        decode_block_tables=tables,
        decode_context_lens=step.meta.decode_context_lens,
        block_size=16,
    )
    outs = []
    for backend in (TorchSDPABackend(), get_attention_backend("flex", "cpu", 16)):
        k_cache, v_cache = step.clone_caches()
        outs.append(backend.forward(step.query, step.key, step.value, k_cache, v_cache, meta, 0.2))
    assert (outs[0] - outs[1]).abs().max() <= TOLERANCE[torch.float32]


def _flash_reference(q, k_cache, v_cache, layout, scale):
    """flash_attn_varlen_func's documented semantics with a block_table, in plain torch: per
    request, keys are the first seqlen_k slots of its pages in table order; causal aligned to
    the bottom right (query i of q_len sees keys 0 .. k_len - q_len + i)."""
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    for i in range(layout.block_table.shape[0]):
        q0, q1 = int(layout.cu_seqlens_q[i]), int(layout.cu_seqlens_q[i + 1])
        k_len = int(layout.cu_seqlens_k[i + 1] - layout.cu_seqlens_k[i])
        assert k_len <= layout.max_seqlen_k and q1 - q0 <= layout.max_seqlen_q
        pages = layout.block_table[i, : -(-k_len // block_size)].long()
        k = k_cache[pages].flatten(0, 1)[:k_len]  # [k_len, kv_heads, head_dim]
        v = v_cache[pages].flatten(0, 1)[:k_len]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), k.double()) * scale
        q_len = q1 - q0
        visible = torch.arange(k_len)[None, :] <= (k_len - q_len + torch.arange(q_len))[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v.double()).to(q.dtype)
    return out


@pytest.mark.parametrize(("block_size", "requests"), [(256, LONG), (256, MIXED), (16, MIXED)])
def test_the_flash_attn_layout_gives_sdpa_s_answer(block_size, requests):
    step = random_step(requests, num_heads=8, num_kv_heads=2, head_dim=64,
                       block_size=block_size, dtype=torch.float32, device="cpu")  # fmt: skip
    layout = flash_layout(step.meta)
    for name in ("cu_seqlens_q", "cu_seqlens_k", "block_table"):
        assert getattr(layout, name).dtype == torch.int32, name  # what flash-attn requires
    assert layout.block_table.shape[0] == len(requests)
    assert layout.block_table.is_contiguous()
    # The slot mapping writes each new token where the layout later reads it: the slot of
    # query j of request i is block_table[i][pos // block_size] * block_size + pos % block_size.
    for i in range(len(requests)):
        q0, q1 = int(layout.cu_seqlens_q[i]), int(layout.cu_seqlens_q[i + 1])
        k_len = int(layout.cu_seqlens_k[i + 1] - layout.cu_seqlens_k[i])
        positions = torch.arange(k_len - (q1 - q0), k_len)
        table = layout.block_table[i].long()
        want = table[positions // block_size] * block_size + positions % block_size
        assert torch.equal(step.meta.slot_mapping[q0:q1], want)
    k_cache, v_cache = step.clone_caches()
    scale = 64**-0.5
    want = TorchSDPABackend().forward(
        step.query, step.key, step.value, k_cache, v_cache, step.meta, scale
    )
    got = _flash_reference(step.query, k_cache, v_cache, layout, scale)  # cache as written
    assert (got - want).abs().max() <= TOLERANCE[torch.float32]


def test_flash_attn_page_size_rule_names_block_size():
    check_flash_block_size(256)
    check_flash_block_size(512)
    with pytest.raises(ValueError, match=r"^block_size: .*multiple of 256, got 16"):
        check_flash_block_size(16)


class _Zeros(AttentionBackend):
    """A wrong build: runs without raising and returns zeros."""

    name = "zeros"

    def forward(self, query, key, value, k_cache, v_cache, meta, scale):
        TorchSDPABackend().forward(query, key, value, k_cache, v_cache, meta, scale)
        return torch.zeros_like(query)


def test_the_self_test_refuses_a_backend_that_returns_zeros(caplog):
    shape = dict(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, device="cpu")
    with pytest.raises(AttentionSelfTestError, match=r"'zeros' disagrees .*Versions: .*torch"):
        self_test(_Zeros(), dtype=torch.float32, **shape)
    error = self_test(get_attention_backend("flex", "cpu", 16), dtype=torch.bfloat16, **shape)
    assert error <= TOLERANCE[torch.bfloat16]


def test_the_registry_names_attention_backend_in_its_errors(monkeypatch):
    assert resolve_backend_name("auto", "cpu", 16) in ("cpu_paged", "torch_sdpa")
    with pytest.raises(ValueError, match=r"^attention_backend: 'flash_attn' runs on CUDA"):
        get_attention_backend("flash_attn", "cpu", 256)
    with pytest.raises(ValueError, match=r"^attention_backend: 'cpu_paged' runs on the CPU"):
        get_attention_backend("cpu_paged", "cuda", 16)
    with pytest.raises(ValueError, match=r"^attention_backend: unknown 'nope'"):
        get_attention_backend("nope", "cpu", 16)
    if HAS_TRITON:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match=r"^attention_backend: 'triton' runs on CUDA"):
            get_attention_backend("triton", "cpu", 16)


@needs_triton
@pytest.mark.parametrize("backend", ["triton", "flex"])
def test_an_engine_on_each_backend_decodes_as_the_reference(backend, tiny_llama):
    """Greedy output of a whole engine (prefill, chunked prefill, batched decode) on the backend
    equals transformers'."""
    from services.engine import EngineConfig, SamplingParams
    from services.engine.llm import LLM
    from tests.reference import assert_equivalent, hf_greedy

    prompts = [list(range(3, 40)), list(range(50, 60)), list(range(100, 170))]
    llm = LLM(EngineConfig(model=tiny_llama, attention_backend=backend, block_size=16,
                           max_num_batched_tokens=48, num_blocks=64))  # fmt: skip
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_equivalent(out.token_ids, hf_greedy(tiny_llama, prompt, 8), context=backend)
