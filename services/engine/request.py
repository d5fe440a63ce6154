"""A request's state inside one engine, and its lifecycle."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from services.engine.block_hash import BlockHash
from services.engine.objectives import StreamObjectives
from services.engine.outputs import RequestMetrics, RequestOutput, TokenLogprobs
from services.engine.sampling_params import SamplingParams
from services.kv_transfer.handle import KVHandle


class RequestStatus(enum.Enum):
    """Lifecycle of a request in an engine; one `Request` method per transition."""

    WAITING = "waiting"  # queued for (re)computation of its KV
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # DECODE role: prompt KV not landed yet
    RUNNING = "running"  # has blocks, computes a chunk or one token per step
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop token
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"  # abort() by the caller
    FINISHED_PREFILLED = "finished_prefilled"  # PREFILL role: first token out, KV held for export
    FINISHED_ERROR = "finished_error"  # DECODE role: the prompt KV could not be pulled
    FINISHED_KV_TIMEOUT = "finished_kv_timeout"  # DECODE role: the prompt KV did not arrive in time

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_PREFILLED: "prefilled",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_KV_TIMEOUT: "kv_timeout",
}


@dataclass
class Request:
    """One request: its tokens, how many of them have KV in the cache, and its blocks.

    `all_token_ids` = prompt + generated; `num_computed_tokens` of them have K/V written in the
    blocks of `block_table`. A step schedules `all_token_ids[num_computed_tokens:]` (or a chunk).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    """Effective sampling seed (the request's own or one drawn by the engine)."""
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    kv_handle: KVHandle | None = None
    """DECODE role: where this request's prompt KV lives."""
    cache_salt: str | None = None
    """Part of every block hash: requests share cached prefixes only with equal salts."""
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    """One entry per output token when `sampling_params.logprobs` is set, else empty."""
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    """Chained hashes of the request's full blocks, as far as they have been needed."""
    num_hashed_blocks: int = 0
    """Leading blocks of `block_table` already offered to the prefix cache."""
    num_cached_tokens: int | None = None
    """Prompt tokens whose KV came from the prefix cache at first admission (None before)."""
    kv_first_block: int = 0
    """DECODE role: prompt blocks found in the local prefix cache; the transfer pulls the rest."""
    kv_deadline: float = float("inf")
    """DECODE role: monotonic time by which the prompt KV must have been loaded."""
    kv_landed: bool = False
    """DECODE role: a caller wrote the pulled prompt KV into the blocks (`Engine.kv_written`)."""
    first_scheduled_time: float | None = None
    """When a step first scheduled the request (monotonic seconds; kept through preemption)."""
    first_token_time: float | None = None
    """When this engine first sampled a token for the request (monotonic seconds)."""
    num_preemptions: int = 0
    """Times this request was preempted (its KV recomputed)."""
    objectives: StreamObjectives = field(default_factory=StreamObjectives)
    """This stream's own ITL and TPOT objectives (a field None: the engine's `slo_itl_ms` /
    `slo_tpot_ms`): the per-step token budget keeps them (`step_budget.py`)."""

    @property
    def recompute_cause(self) -> str:
        """Why this engine runs the request's prompt positions, for
        `pdserve_decode_recomputed_prompt_tokens_total{cause}`: "preemption" (its KV was freed),
        "fallback" (a DECODE request whose prompt KV should have come from its handle) or
        "local_prefill" (a prompt this engine was asked to prefill)."""
        if self.num_preemptions:
            return "preemption"
        return "fallback" if self.kv_handle is not None else "local_prefill"

    def output(self, new: list[int], handle: KVHandle | None = None) -> RequestOutput:
        """This step's news: `new` token ids (with their logprobs when asked for), `handle`
        for a PREFILL hand-off."""
        logprobs = self.output_logprobs
        new_logprobs = tuple(logprobs[len(logprobs) - len(new) :]) if logprobs else ()
        return RequestOutput(
            self.request_id,
            new,
            list(self.output_token_ids),
            self.status.is_finished,
            self.status.finish_reason,
            handle,
            new_logprobs,
            self.num_cached_tokens or 0,
            self.metrics,
        )

    @property
    def metrics(self) -> RequestMetrics | None:
        """Its milestones, once it has its first sampled token (else None)."""
        if self.first_scheduled_time is None or self.first_token_time is None:
            return None
        return RequestMetrics(self.arrival_time, self.first_scheduled_time, self.first_token_time)

    @property
    def remote_handle(self) -> KVHandle:
        """The KV handle of a DECODE request (only those have one)."""
        assert self.kv_handle is not None, f"{self.request_id} has no KV handle"
        return self.kv_handle

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    # -- transitions ---------------------------------------------------------------------------

    def start_running(self, now: float) -> None:
        """Scheduled by the step starting at `now` (monotonic seconds)."""
        assert self.status in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KV)
        self.status = RequestStatus.RUNNING
        if self.first_scheduled_time is None:
            self.first_scheduled_time = now

    def preempt(self) -> None:
        """Back to WAITING; the caller has freed its blocks, its KV will be recomputed."""
        assert self.status == RequestStatus.RUNNING
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions += 1

    def finish(self, status: RequestStatus) -> None:
        assert status.is_finished and not self.status.is_finished
        self.status = status

    def append_output_token(
        self, token_id: int, max_model_len: int, logprobs: TokenLogprobs | None = None
    ) -> None:
        """Record a sampled token (and its log-probabilities, if asked for) and finish the
        request if it hit a stop condition."""
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        params = self.sampling_params
        if not params.ignore_eos and token_id == self.eos_token_id:
            self.finish(RequestStatus.FINISHED_STOPPED)
        elif token_id in params.stop_token_ids:
            self.finish(RequestStatus.FINISHED_STOPPED)
        elif self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            self.finish(RequestStatus.FINISHED_LENGTH)
