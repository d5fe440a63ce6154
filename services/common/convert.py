"""The one module that converts between protobuf messages and engine dataclasses.

Imports no torch: the router converts sampling parameters and logprobs; only the KV layout
conversions (worker side) load torch, when first called.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

from services.common.pb import common_pb2, generate_pb2
from services.engine.config import DTYPES
from services.engine.outputs import TokenLogprobs
from services.engine.sampling_params import SamplingParams
from services.kv_transfer.handle import KV_TENSOR_LAYOUT, KVHandle

if TYPE_CHECKING:
    import torch

    from services.engine.kv_cache import KVCacheSpec
    from services.kv_transfer.handshake import KVPeerInfo


@cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {name: getattr(torch, name) for name in DTYPES}


def dtype_name(dtype: torch.dtype) -> str:
    """ "float32" for torch.float32 (the KV dtypes only)."""
    return str(dtype).removeprefix("torch.")


_OPTIONAL_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take the engine defaults; ValueError names a bad field (the
    message's `stop` strings are not engine parameters: read them from `msg.stop`)."""
    kwargs = {name: getattr(msg, name) for name in _OPTIONAL_SAMPLING_FIELDS if msg.HasField(name)}
    return SamplingParams(
        **kwargs,
        ignore_eos=msg.ignore_eos,
        stop_token_ids=tuple(msg.stop_token_ids),
        logit_bias=tuple(msg.logit_bias.items()),
    )


def sampling_to_proto(
    params: SamplingParams, stop: list[str] | None = None
) -> common_pb2.SamplingParams:
    """Penalties at their defaults and unset optionals stay unset (the defaults on arrival)."""
    msg = common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        ignore_eos=params.ignore_eos,
        stop_token_ids=list(params.stop_token_ids),
        stop=stop or [],
        logit_bias=dict(params.logit_bias),
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.presence_penalty != 0:
        msg.presence_penalty = params.presence_penalty
    if params.frequency_penalty != 0:
        msg.frequency_penalty = params.frequency_penalty
    if params.repetition_penalty != 1:
        msg.repetition_penalty = params.repetition_penalty
    return msg


def logprobs_to_proto(logprobs: TokenLogprobs) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=logprobs.token_id,
        logprob=logprobs.logprob,
        rank=logprobs.rank,
        top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in logprobs.top],
    )


def logprobs_from_proto(msg: common_pb2.TokenLogprob) -> TokenLogprobs:
    top = tuple((t.token_id, t.logprob) for t in msg.top)
    return TokenLogprobs(msg.token_id, msg.logprob, msg.rank, top)


def handle_to_proto(handle: KVHandle, source: str) -> common_pb2.KVHandle:
    return common_pb2.KVHandle(
        request_id=handle.request_id,
        engine_id=handle.engine_id,
        block_ids=list(handle.block_ids),
        num_tokens=handle.num_tokens,
        first_token_id=handle.first_token_id,
        source=source,
    )


def handle_from_proto(msg: common_pb2.KVHandle) -> tuple[KVHandle, str]:
    """(engine handle, HOST:PORT of the source's KVTransfer service)."""
    handle = KVHandle(
        msg.request_id, msg.engine_id, tuple(msg.block_ids), msg.num_tokens, msg.first_token_id
    )
    return handle, msg.source


def layout_to_proto(spec: KVCacheSpec, layout: str = KV_TENSOR_LAYOUT) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        block_size=spec.block_size,
        dtype=dtype_name(spec.dtype),
        layout=layout,
    )


def layout_from_proto(msg: common_pb2.KVLayout) -> KVCacheSpec:
    """Raises ValueError for an unknown dtype or tensor layout."""
    if msg.layout != KV_TENSOR_LAYOUT:
        raise ValueError(f"kv_layout.layout: expected {KV_TENSOR_LAYOUT!r}, got {msg.layout!r}")
    return _spec_from_proto(msg)


def _spec_from_proto(msg: common_pb2.KVLayout) -> KVCacheSpec:
    from services.engine.kv_cache import KVCacheSpec

    if msg.dtype not in DTYPES:
        raise ValueError(f"kv_layout.dtype: unknown {msg.dtype!r}")
    dtype = _torch_dtypes()[msg.dtype]
    return KVCacheSpec(msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.block_size, dtype)


def peer_info_to_proto(info: KVPeerInfo) -> tuple[str, common_pb2.KVLayout]:
    """(model_id, layout) of a handshake message."""
    return info.model_id, layout_to_proto(info.spec, info.layout)


def peer_info_from_proto(model_id: str, msg: common_pb2.KVLayout) -> KVPeerInfo:
    """A peer's handshake fields, kept as sent (an unknown layout string is a mismatch to
    report, not a parse error); raises ValueError only for an unknown dtype name."""
    from services.kv_transfer.handshake import KVPeerInfo

    return KVPeerInfo(model_id, _spec_from_proto(msg), msg.layout)


def timings_to_dict(timings: generate_pb2.Timings) -> dict[str, float | str]:
    """A response's `Timings` as JSON: every leg in seconds, and the path."""
    return {f.name: getattr(timings, f.name) for f in timings.DESCRIPTOR.fields}
