"""Linear layers with weights prepacked for oneDNN, the CPU matmul path of inference engines.

A decode step multiplies a few dozen rows by every weight matrix; at that shape the stock
`F.linear` (MKL sgemm on a row-major weight) leaves much of the CPU unused. Reordering each weight
once into oneDNN's blocked layout, as torch inductor's CPU "freezing" pass and Intel's extension
for PyTorch do, measured 1.3-2.5x faster per matmul on this machine, in float32 and bfloat16 alike,
with float32 results as exact as MKL's (same accumulation precision, different summation order).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

# oneDNN picks the packed layout for this many rows; any row count still works with it.
BATCH_SIZE_HINT = 64
_PACKABLE = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    """`y = x @ W^T + b` with W reordered once for oneDNN; x: [num_tokens, in_features]."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.register_buffer(
            "packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_SIZE_HINT)
        )
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def packing_available(device: str, dtype: torch.dtype) -> bool:
    """True when oneDNN can run this dtype on this device (CPU, float32 or bfloat16)."""
    return (
        device == "cpu"
        and dtype in _PACKABLE
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_linear(linear: nn.Linear) -> nn.Module:
    """A `PackedLinear` equal to `linear` (checked once on random rows), else `linear` itself."""
    weight = linear.weight
    if not packing_available(weight.device.type, weight.dtype):
        return linear
    try:
        packed = PackedLinear(linear)
        probe = torch.randn(3, linear.in_features, dtype=weight.dtype)
        expected, got = F.linear(probe, weight, linear.bias), packed(probe)
    except RuntimeError as exc:  # an older torch or a CPU oneDNN cannot serve: keep the stock path
        logger.warning("oneDNN weight packing unavailable (%s); using F.linear", exc)
        return linear
    tolerance = 1e-3 if weight.dtype == torch.float32 else 5e-2
    if not torch.allclose(got.float(), expected.float(), rtol=tolerance, atol=tolerance):
        logger.warning("oneDNN packed linear disagrees with F.linear; using F.linear")
        return linear
    return packed
