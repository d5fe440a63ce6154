"""The fused CPU layer ops (services/engine/kernels/fused_ops.cpp) against transformers' modules:
bit for bit in bfloat16, to an ulp in float32, and a whole model's greedy output and logprobs
unchanged by them."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, rotate_half

from services.engine import SamplingParams
from services.engine.kernels import load_cpu_kernels
from services.engine.models.layer_ops import LayerOps
from tests.engine.helpers import GREEDY, make_engine

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="no C++ toolchain here")

DTYPES = [torch.bfloat16, torch.float32]


def _check(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if actual.dtype == torch.bfloat16:
        assert torch.equal(actual, expected), (actual.float() - expected.float()).abs().max()
    else:  # float32: a fused multiply-add or another summation order moves the last bit
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=2e-6)


@pytest.fixture
def ops() -> LayerOps:
    return LayerOps(load_cpu_kernels())


def _norm(dtype: torch.dtype, hidden: int = 576) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(hidden, dtype=dtype)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])  # a decode row, a small batch, a prompt (threaded)
def test_rms_norm_and_residual_add(ops, dtype, rows):
    torch.manual_seed(rows)
    norm = _norm(dtype)
    x = torch.randn(rows, 576, dtype=dtype) * 3
    residual = torch.randn_like(x)
    _check(ops.rms_norm(x, norm), norm(x))
    expected_residual = residual + x
    out, new_residual = ops.add_rms_norm(x.clone(), residual.clone(), norm)
    _check(new_residual, expected_residual)
    _check(out, norm(expected_residual))


def test_rms_norm_reads_strided_rows(ops):
    """The final norm reads rows picked out of the batch; a strided view works as a copy does."""
    norm = _norm(torch.bfloat16, 64)
    wide = torch.randn(10, 128, dtype=torch.bfloat16)
    _check(ops.rms_norm(wide[:, :64], norm), norm(wide[:, :64].contiguous()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 300])
def test_silu_and_mul(ops, dtype, rows):
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536, dtype=dtype) * 4
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -1e-3])  # the exp's clamps, zero, tiny
    gate, up = gate_up.chunk(2, dim=-1)
    _check(ops.silu_and_mul(gate_up, torch.nn.SiLU()), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 300])
def test_rotary_in_place_on_the_qkv_buffer(ops, dtype, rows):
    """q and k rotate in place inside the fused qkv output; v, beside them, is untouched."""
    torch.manual_seed(rows)
    num_qk_heads, num_v_heads, head_dim = 12, 3, 64
    qkv = torch.randn(rows, (num_qk_heads + num_v_heads) * head_dim, dtype=dtype)
    v_before = qkv[:, num_qk_heads * head_dim :].clone()
    qk = qkv[:, : num_qk_heads * head_dim].view(rows, num_qk_heads, head_dim)
    angles = torch.rand(rows, head_dim) * 1000
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected = qk * cos[:, None] + rotate_half(qk) * sin[:, None]
    out = ops.rotary(qk, cos, sin)
    assert out.data_ptr() == qkv.data_ptr()
    _check(out, expected)
    assert torch.equal(qkv[:, num_qk_heads * head_dim :], v_before)


def test_kernels_reject_bad_input(ops):
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.silu_and_mul(torch.randn(2, 8, dtype=torch.float16), torch.nn.SiLU())
    with pytest.raises(RuntimeError, match="gate_up"):
        ops.kernels.silu_and_mul(torch.empty(2, 3), torch.empty(2, 8))
    with pytest.raises(RuntimeError, match="weight"):
        ops.kernels.rms_norm(torch.empty(2, 8), torch.empty(2, 8), torch.empty(4), 1e-5)


def test_model_output_unchanged_by_fusion(tiny_model):
    """A bfloat16 model's greedy tokens and their logprobs are the same through the fused ops as
    through transformers' modules (and so is every top-5 alternative)."""
    params = SamplingParams(max_tokens=12, logprobs=5, **GREEDY)
    prompts = {"a": list(range(3, 40)), "b": list(range(100, 105)), "c": [7] * 70}
    results = []
    for fused in (True, False):
        engine = make_engine(tiny_model, dtype="bfloat16", num_blocks=256)
        assert engine.runner.model.ops.fused  # the CPU default
        if not fused:
            engine.runner.model.ops = LayerOps(None)
        for rid, prompt in prompts.items():
            engine.add_request(prompt, params, request_id=rid)
        outs: dict[str, list] = {rid: [] for rid in prompts}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs[out.request_id].extend(zip(out.new_token_ids, out.new_logprobs, strict=True))
        results.append(outs)
    assert all(len(tokens) == 12 for tokens in results[0].values())
    assert results[0] == results[1]
