"""What the engine returns to its caller, per step and per finished request."""

from __future__ import annotations

from dataclasses import dataclass

from services.kv_transfer.handle import KVHandle


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities (natural log) of one sampled token under the model's raw distribution."""

    token_id: int
    logprob: float
    rank: int  # 1 + how many tokens had a strictly higher log-probability
    top: tuple[tuple[int, float], ...]  # the `logprobs` most likely (token_id, logprob), best first


@dataclass(frozen=True)
class RequestMetrics:
    """When one request passed the engine's milestones (`time.monotonic()` seconds), as vLLM's
    `RequestMetrics` names them. `first_token_time` is this engine's first sampled token: the
    prefill's on a PREFILL or BOTH engine (and a local prefill on a DECODE one), the first
    decode step's for a DECODE request whose prompt KV came from a transfer."""

    arrival_time: float
    first_scheduled_time: float
    first_token_time: float

    @property
    def time_in_queue(self) -> float:
        """Seconds from arrival to the first step that scheduled the request (a DECODE request
        with remote KV waits here for blocks and for its KV)."""
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float:
        """Seconds of compute from the first scheduling step to the first sampled token (a
        chunked prompt's chunks, and the steps in between)."""
        return self.first_token_time - self.first_scheduled_time


@dataclass(frozen=True)
class RequestOutput:
    """One step's news for one request."""

    request_id: str
    new_token_ids: list[int]
    output_token_ids: list[int]  # all generated so far
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | "prefilled" (PREFILL)
    kv_handle: KVHandle | None = None  # PREFILL role: where the prompt's KV is pinned
    new_logprobs: tuple[TokenLogprobs, ...] = ()  # one per new token when the request asked
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    metrics: RequestMetrics | None = None  # once the request has its first sampled token


@dataclass(frozen=True)
class KVReserved:
    """DECODE role: a request's blocks are reserved; its prompt KV is due from `first_block` on
    (the blocks before it came from the local prefix cache), into `block_ids` (one per handle
    block from `first_block` on)."""

    request_id: str
    first_block: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class CompletionOutput:
    """A finished request from `LLM.generate`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None  # None when the model folder has no tokenizer
    finish_reason: str
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token when the request asked
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
