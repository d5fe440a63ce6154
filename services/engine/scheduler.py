"""Iteration-level scheduler (Orca; vLLM v1): every step picks which tokens of which requests run.

Prefill and decode are one mechanism: a request has `num_computed_tokens` of its `all_token_ids`
in the cache, and a step computes the next `min(remaining, budget)` of them. A decode is simply a
request with one token left to compute; a long prompt is chunked by `max_num_batched_tokens`.
When blocks run out, the newest running request is preempted and later recomputed (vLLM's
RECOMPUTE preemption), keeping its generated tokens.

Admission is first come, first served (a long prompt is never starved) and looks up the prefix
cache first: a request starts with the cached blocks of its longest cached prefix and computes
only the rest. At least the last prompt token is always computed, since its logits give the
first token, so a hit covers at most `block_hash.max_cached_blocks` blocks. With a cost model
a prompt joins a step already computing prompts only where that lowers the total TTFT
(`step_budget.worth_packing`); without one `max_num_batched_tokens` alone bounds a step.

A DECODE request whose prompt KV comes from a transfer holds its blocks before it gets here
(`remote_kv.py` reserves them); `schedule(ready_remote)` starts those whose KV can be loaded
now, ahead of the waiting queue, and lists their loads in `SchedulerOutput.remote_loads`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.engine.block_hash import max_cached_blocks
from services.engine.config import EngineConfig
from services.engine.kv_cache import KVCache
from services.engine.request import Request, RequestStatus
from services.engine.sampler import SamplingRow, TokenLogprobs
from services.engine.step_budget import (
    LiveScale,
    StepBudget,
    prompt_deadline_s,
    streams_allow_s,
    worth_packing,
)
from services.kv_transfer.handle import KVHandle


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's work in a step: compute `token_ids` at positions start_position.. ."""

    request_id: str
    token_ids: list[int]
    start_position: int
    block_table: list[int]
    sample: SamplingRow | None  # None while a chunked prompt has tokens left after this step


@dataclass(frozen=True)
class RemoteLoad:
    """DECODE role: copy `handle`'s blocks into request `request_id`'s `block_ids` before the
    step."""

    request_id: str
    handle: KVHandle
    block_ids: list[int]
    first_block: int = 0  # blocks before this one came from the local prefix cache: not pulled


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    remote_loads: list[RemoteLoad] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    now: float = 0.0  # when the step was scheduled (time.monotonic() seconds)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)


RECOMPUTE_CAUSES = ("preemption", "local_prefill", "fallback")  # Request.recompute_cause


class Scheduler:
    """Owns the waiting and running queues and every request's blocks."""

    def __init__(self, config: EngineConfig, kv_cache: KVCache) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # prompt positions run through the model (recomputes included), and the same by cause
        self.num_prompt_tokens_computed = 0
        self.prompt_tokens_computed_by_cause = dict.fromkeys(RECOMPUTE_CAUSES, 0)
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache at admission
        self.prefix_cache_hits = 0  # of those, tokens whose KV was reused
        self.step_budget: StepBudget | None = None  # set once a cost model is known
        self.live_scale = LiveScale()  # observed / predicted seconds of recent mixed steps
        self.last_prefill_budget: int | None = None  # the last step's (None: uncapped)

    def add(self, request: Request) -> None:
        """Queue a request (first come, first served)."""
        self.waiting.append(request)

    def has_work(self) -> bool:
        """Whether a request runs or waits (reserved DECODE requests are `remote_kv`'s)."""
        return bool(self.running or self.waiting)

    def schedule(self, ready_remote: Sequence[Request] = ()) -> SchedulerOutput:
        """This step's work: the running requests first (preempting the newest when blocks run
        out), then `ready_remote` (DECODE requests holding their blocks, whose prompt KV can be
        loaded now, in arrival order), then the waiting queue, within `max_num_batched_tokens`
        and `max_num_seqs`. A remote request left out stays with its caller for a later step."""
        out = SchedulerOutput(now=time.monotonic())
        budget = self.config.max_num_batched_tokens
        prefill_budget = self._prefill_budget(budget, out.now)
        for request in list(self.running):
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining, budget if remaining == 1 else min(budget, prefill_budget))
            if num_new == 0 or not self._allocate_or_preempt(request, num_new, out):
                continue
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            if remaining > 1:
                prefill_budget -= num_new
        if not out.preempted_ids:
            budget = self._admit_remote(ready_remote, out, budget)
            self._admit_waiting(out, min(budget, prefill_budget))
        return out

    def _prefill_budget(self, cap: int, now: float) -> int:
        """Prompt tokens this step may compute besides its decode rows (`step_budget.py`): the
        largest chunk whose predicted step fits the tightest allowance of the streams decoding
        in it (`streams_allow_s`), widened to what the next prompt's TTFT objective needs
        (`prompt_deadline_s`); `cap` without these, or without a cost model."""
        self.last_prefill_budget = None
        if self.step_budget is None:  # no cost model: nothing to compute on the hot path
            return cap
        decodes = [
            r for r in self.running
            if r.status == RequestStatus.RUNNING and r.num_tokens - r.num_computed_tokens == 1
        ]  # fmt: skip
        if not decodes:
            return cap
        contexts, budget = [r.num_tokens for r in decodes], self.step_budget
        itl = None if self.config.slo_itl_ms is None else self.config.slo_itl_ms / 1000
        tpot = self.config.slo_tpot_ms / 1000
        step_s = streams_allow_s(decodes, budget.decode_step_s(contexts), itl, tpot, now)
        chunked = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        cached = chunked[0].num_computed_tokens if chunked else 0
        prompt = chunked[0] if chunked else (self.waiting[0] if self.waiting else None)
        if prompt is not None and prompt.objectives.ttft_s is not None:
            need = prompt_deadline_s(budget, prompt, cached, decodes, contexts, itl, cap, now)
            step_s = max(step_s, need)
        step_s /= self.live_scale.ratio(budget.cost.threads)
        tokens = budget.prefill_tokens(contexts, cached, step_s, cap - len(decodes))
        self.last_prefill_budget = tokens
        return tokens

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv_cache.allocate_slots(request, num_new):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        request.preempt()
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        block_size = self.kv_cache.spec.block_size
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            cached = self.kv_cache.get_computed_blocks(
                request, max_cached_blocks(request.num_tokens, block_size)
            )
            num_cached = len(cached) * block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if self.step_budget is not None:  # without a cost model the token budget alone packs
                rows = [(len(s.token_ids), s.start_position) for s in out.scheduled]
                done = num_new == request.num_tokens - num_cached
                behind = len(self.waiting) - 1
                if not worth_packing(self.step_budget, rows, (num_new, num_cached), behind, done):
                    break
            if not self.kv_cache.allocate_slots(request, num_new, cached):
                break
            request.num_computed_tokens = num_cached
            self.waiting.popleft()
            self.record_prefix_hit(request, request.num_tokens, num_cached)
            self._start(request, num_new, out)
            budget -= num_new

    def _admit_remote(self, ready: Sequence[Request], out: SchedulerOutput, budget: int) -> int:
        """Start DECODE requests whose prompt KV is ready: each loads it before the step and
        computes its first token."""
        for request in ready:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            request.num_computed_tokens = request.remote_handle.num_tokens
            out.remote_loads.append(
                RemoteLoad(
                    request.request_id,
                    request.remote_handle,
                    list(request.block_table),
                    request.kv_first_block,
                )
            )
            num_new = request.num_tokens - request.num_computed_tokens
            self._start(request, num_new, out)
            budget -= num_new
        return budget

    def record_prefix_hit(self, request: Request, num_queried: int, num_cached: int) -> None:
        """Count a lookup of `num_queried` tokens that found `num_cached`; the first admission's
        hit is the request's `num_cached_tokens`."""
        if self.kv_cache.prefix_caching:
            self.prefix_cache_queries += num_queried
            self.prefix_cache_hits += num_cached
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_cached

    def _start(self, request: Request, num_new: int, out: SchedulerOutput) -> None:
        request.start_running(out.now)
        self.running.append(request)
        out.scheduled.append(self._scheduled(request, num_new))

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        sample = None
        if end == request.num_tokens:
            sample = SamplingRow(
                request.sampling_params,
                request.seed,
                request.num_output_tokens,
                request.prompt_token_ids,
                request.output_token_ids,
            )
        return ScheduledRequest(
            request.request_id,
            request.all_token_ids[start:end],
            start,
            list(request.block_table),
            sample,
        )

    def update(
        self,
        out: SchedulerOutput,
        sampled: dict[str, int],
        logprobs: dict[str, TokenLogprobs],
        requests: dict[str, Request],
    ) -> list[Request]:
        """Advance computed counts and append sampled tokens; returns requests that got a token."""
        got_token, now = [], time.monotonic()
        for item in out.scheduled:
            request = requests[item.request_id]
            end = item.start_position + len(item.token_ids)
            prompt_positions = max(0, min(end, len(request.prompt_token_ids)) - item.start_position)
            self.num_prompt_tokens_computed += prompt_positions
            self.prompt_tokens_computed_by_cause[request.recompute_cause] += prompt_positions
            request.num_computed_tokens = end
            self.kv_cache.cache_full_blocks(request)
            if item.request_id in sampled:
                request.append_output_token(
                    sampled[item.request_id], self.max_model_len, logprobs.get(item.request_id)
                )
                if request.first_token_time is None:
                    request.first_token_time = now
                got_token.append(request)
        return got_token

    @property
    def max_model_len(self) -> int:
        assert self.config.max_model_len is not None
        return self.config.max_model_len

    def remove_running(self, request: Request, *, free: bool = True) -> None:
        """Take a request out of the queues; `free=False` keeps its blocks (PREFILL hand-off)."""
        for queue in (self.running, self.waiting):
            if request in queue:
                queue.remove(request)
                break
        if free:
            self.kv_cache.free(request)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a slot or blocks."""
        return len(self.waiting)
