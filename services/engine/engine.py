"""The transport-free engine: add_request / step / abort (`llm.py` runs prompts to completion).

One step = schedule -> (load remote KV) -> model runner -> update -> outputs (nano-vllm's three
verbs plus the KV hand-off). Services wrap this class; it never imports grpc, ray or prometheus.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from services.cost_model.step_cost import StepCost
from services.cost_model.store import CostModelKey, machine_id
from services.engine.block_hash import BlockHash
from services.engine.config import EngineConfig, EngineRole
from services.engine.cuda_graphs import decode_graphs
from services.engine.errors import InvalidRequestError, KVHandshakeError, RequestNotFoundError
from services.engine.kv_cache import KVCache
from services.engine.kv_events import KVEvent
from services.engine.kv_export import KVExport
from services.engine.kv_reservations import KVReservations
from services.engine.loader import eos_token_id, load_model, model_id, model_limits, resolve_model
from services.engine.memory import num_kv_blocks
from services.engine.model_runner import ModelRunner
from services.engine.objectives import StreamObjectives
from services.engine.outputs import KVReserved, RequestOutput
from services.engine.remote_kv import RemoteKV
from services.engine.request import Request, RequestStatus
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler, SchedulerOutput
from services.engine.step_budget import StepBudget
from services.engine.tokenizer import Tokenizer
from services.engine.validation import RequestChecker
from services.engine.warmup import warm_up
from services.kv_transfer.base import KVReceiver
from services.kv_transfer.handle import KVHandle
from services.kv_transfer.handshake import KVPeerInfo
from services.kv_transfer.in_memory import InMemoryKVReceiver
from services.kv_transfer.sender import KVSender


class Engine:
    """A paged-KV inference engine in one of the roles BOTH, PREFILL or DECODE.

    `kv_sender` (PREFILL role) publishes the pinned prompt KV of finished requests (default: one
    of its own, for receivers in this process); `kv_receiver` (DECODE role) brings a request's
    prompt KV in. Raises ValueError (naming the field) for a bad config or unsupported model.
    """

    def __init__(
        self,
        config: EngineConfig,
        kv_sender: KVSender | None = None,
        kv_receiver: KVReceiver | None = None,
    ) -> None:
        self.model_path = str(resolve_model(config.model))
        _, max_model_len = model_limits(self.model_path, config.max_model_len)
        self.config = config = dataclasses.replace(config, max_model_len=max_model_len)
        self.model, hf_config = load_model(self.model_path, config)
        spec = self.model.kv_cache_spec(config.block_size, config.torch_dtype)
        num_blocks = num_kv_blocks(config, spec, self.model)
        self.model_id = model_id(Path(self.model_path))
        self.kv_sender = kv_sender or KVSender(config.kv_lease_seconds)
        self.kv_cache = KVCache(
            spec,
            num_blocks,
            config.device,
            shuffle=config.shuffle_free_blocks,
            seed=config.seed,
            model_id=self.model_id if config.enable_prefix_caching else None,
            record_events=config.enable_kv_events,
            allocate=functools.partial(self.kv_sender.allocate_kv, config.engine_id),
        )
        self.kv_receiver = kv_receiver or InMemoryKVReceiver(self.kv_sender)
        self.scheduler = Scheduler(config, self.kv_cache)
        self.reservations = KVReservations(config, self.kv_cache, self.scheduler)
        self.remote = RemoteKV(self.kv_cache, self.reservations, self.kv_receiver)
        self.runner = ModelRunner(
            self.model,
            self.kv_cache,
            config.device,
            decode_graphs(config, self.model, self.kv_cache),
        )
        self.tokenizer = Tokenizer.load(self.model_path)
        self.checker = RequestChecker(config, self.runner.vocab_size, num_blocks, self.tokenizer)
        self.eos_token_id = eos_token_id(hf_config, self.tokenizer)
        self.kv_peer_info = KVPeerInfo.of(spec, self.model_id)
        self.export = KVExport(config.engine_id, self.kv_cache, self.kv_sender, self.kv_peer_info)
        self.requests: dict[str, Request] = {}
        self._finished_at_admission: list[Request] = []  # DECODE: first token already ended it
        self.last_step: SchedulerOutput | None = None
        self.last_forward_tokens: dict[str, int] = {}  # request_id -> tokens the last forward saw
        self._seeds = random.Random(config.seed)

    def warm_up(self) -> float:
        """One dummy prefill and one dummy decode forward, leaving no trace (`warmup.py`); returns
        the seconds taken. Raises ResourceExhaustedError when too few blocks are free."""
        return warm_up(self.runner, self.kv_cache, self.scheduler.max_model_len)

    # -- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        kv_handle: KVHandle | None = None,
        cache_salt: str | None = None,
        output_token_ids: list[int] | None = None,
        objectives: StreamObjectives | None = None,
    ) -> str:
        """Queue a request; returns its id.

        DECODE role: `kv_handle` says where the prompt's KV and first token are; the request
        reserves its blocks now (or queues for them) and runs once its KV is loaded. Without
        one, the engine prefills the prompt itself, chunked into the running batch's steps
        (conditional disaggregation's local path, as llm-d and Dynamo route short prompts).
        `cache_salt`: requests share cached prefix blocks only with requests of the same salt
        (vLLM's `cache_salt`: isolates tenants from each other's prefix-cache timing).
        `output_token_ids`: tokens this request already generated on a worker that failed (a
        migration, `services/router/flow/migration.py`). They are outputs, not prompt: the engine
        computes the KV of prompt + them and samples the next token as the failed worker would
        have, since they count against max_tokens, in the penalties and in the seeded stream
        (a seeded draw depends only on (seed, output index): `sampler.py`). A handle then
        covers prompt + them. The engine reports them in `RequestOutput.output_token_ids` but
        never again as new tokens. `objectives`: this stream's ITL and TPOT objectives
        (None, or a field None: the config's `slo_itl_ms` / `slo_tpot_ms`), which the per-step
        token budget keeps.
        Raises InvalidRequestError (empty or too-long prompt, unknown token ids, duplicate id,
        non-string salt, output_token_ids at max_tokens), ResourceExhaustedError (the request
        could never fit in the KV cache, or too many wait for blocks) and KVHandshakeError (the
        handle's source holds KV of another model or layout).
        """
        request_id = self._new_request_id(request_id)
        prompt_ids = self.checker.prompt_ids(prompt)
        if kv_handle is not None:  # first: with another layout, its numbers mean nothing here
            try:
                self.kv_receiver.connect(kv_handle, self.kv_peer_info)
            except KVHandshakeError:
                self.kv_receiver.complete(kv_handle)  # unusable here: let the source unpin now
                raise
        resumed = self.checker.output_ids(output_token_ids, params)
        self.checker.check(request_id, prompt_ids, params, kv_handle, cache_salt, len(resumed))
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        request = Request(
            request_id,
            prompt_ids,
            params,
            seed,
            self.eos_token_id,
            time.monotonic(),
            kv_handle,
            cache_salt,
            output_token_ids=resumed,
            objectives=objectives or StreamObjectives(),
        )
        if kv_handle is not None:
            self._add_remote(request, kv_handle)
        else:
            self.scheduler.add(request)
        self.requests[request_id] = request
        return request_id

    def _new_request_id(self, request_id: str | None) -> str:
        """The caller's id, checked, or a fresh one (unique cluster-wide, as KV handles need)."""
        if request_id is None:
            return f"req-{uuid.uuid4().hex}"
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id", "must be a non-empty string")
        if request_id in self.requests or request_id in self.export.pinned:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        return request_id

    def _add_remote(self, request: Request, kv_handle: KVHandle) -> None:
        """DECODE role: the prefill's first token, then blocks reserved for the prompt's KV
        (ResourceExhaustedError when too many already wait for blocks)."""
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        request.append_output_token(kv_handle.first_token_id, self.scheduler.max_model_len)
        if request.status.is_finished:  # the first token already ended it: nothing to decode
            self.kv_receiver.complete(kv_handle)
            self._finished_at_admission.append(request)
        elif self.config.debug_recompute_prompt:  # test hook: recompute instead of pulling
            self.kv_receiver.complete(kv_handle)
            request.status = RequestStatus.WAITING
            self.scheduler.add(request)
        else:
            self.reservations.add(request)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks. Raises RequestNotFoundError for an unknown id."""
        if self.export.abort(request_id):
            return
        request = self.requests.pop(request_id, None)
        if request is None:
            raise RequestNotFoundError(request_id)
        if request in self._finished_at_admission:
            self._finished_at_admission.remove(request)
            return
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            self._end_remote(request, RequestStatus.FINISHED_ABORTED)
            return
        self.scheduler.remove_running(request)
        request.finish(RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """Whether `step()` has work: a request to compute, a DECODE request whose KV is ready or
        overdue. A DECODE request still waiting for its KV needs no step (`num_waiting_for_kv`)."""
        if self._finished_at_admission or self.scheduler.has_work():
            return True
        return self.remote.has_ready_work()

    @property
    def num_waiting_for_kv(self) -> int:
        """DECODE requests queued for blocks or reserved and waiting for their KV."""
        return len(self.reservations)

    @property
    def num_waiting(self) -> int:
        """Requests not running: waiting for a slot or blocks, or for their remote KV."""
        return self.scheduler.num_waiting + len(self.reservations)

    @property
    def pinned(self) -> dict[str, Request]:
        """PREFILL role: finished requests whose prompt blocks are held for export."""
        return self.export.pinned

    def take_reserved(self, claim_writes: bool = False) -> list[KVReserved]:
        """DECODE role: reserve blocks for queued requests where room allows, then return every
        request reserved since the last call: its KV may be pulled now.

        `claim_writes`: the caller writes each one's pulled KV into its `block_ids` itself (off
        the engine thread, with `kv_cache.write_blocks`) and then calls `kv_written`; until
        then the engine never frees those blocks, even if the request ends. Otherwise the
        engine pulls through the transfer at admission.
        """
        return self.remote.take_reserved(claim_writes)

    def kv_written(self, request_id: str, ok: bool) -> None:
        """DECODE role: the caller that claimed the request's writes is done with its blocks;
        `ok`: every pulled block was written (the request may run). Frees the blocks of a
        request that ended meanwhile."""
        self.remote.written(request_id, self.requests.get(request_id), ok)

    def kv_write_claimed(self, request_id: str) -> bool:
        """DECODE role: a caller claimed the request's writes (`take_reserved(claim_writes=True)`)
        and has not called `kv_written` yet."""
        return self.remote.is_claimed(request_id)

    def _end_remote(self, request: Request, status: RequestStatus) -> RequestOutput:
        self.remote.end(request, status)
        self.requests.pop(request.request_id, None)
        return request.output(request.output_token_ids[-1:])

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for every request that got a token or finished.
        A mixed step's seconds calibrate the step budget (`LiveScale.observe_step`)."""
        started = time.perf_counter()
        outputs = [self._finish(r) for r in self._finished_at_admission]
        self._finished_at_admission.clear()
        outputs += [
            self._end_remote(r, RequestStatus.FINISHED_KV_TIMEOUT)
            for r in self.reservations.timed_out()
        ]
        sched = self.scheduler.schedule(self.remote.ready_requests())
        self.last_step = sched
        outputs += self._load_remote_kv(sched)
        result = self.runner.execute(sched)
        self.last_forward_tokens = result.num_tokens_by_request
        for request in self.scheduler.update(sched, result.sampled, result.logprobs, self.requests):
            if request.status.is_finished:
                outputs.append(self._finish(request))
            elif self.config.role == EngineRole.PREFILL:
                outputs.append(self._hand_off(request))
            else:
                outputs.append(request.output([request.output_token_ids[-1]]))
        if (budget := self.scheduler.step_budget) is not None:
            rows = [(len(s.token_ids), s.start_position) for s in sched.scheduled]
            self.scheduler.live_scale.observe_step(budget.cost, rows, time.perf_counter() - started)
        return outputs

    def _load_remote_kv(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """DECODE role: load each newly admitted request's prompt KV. A request whose KV cannot
        be loaded ends with finish_reason "error" and frees its blocks; the step goes on
        without it."""
        failed = self.remote.load(sched.remote_loads, self.requests)
        failed_ids = {r.request_id for r in failed}
        sched.scheduled = [s for s in sched.scheduled if s.request_id not in failed_ids]
        for request in failed:
            request.finish(RequestStatus.FINISHED_ERROR)
        return [self._finish(request) for request in failed]

    def _finish(self, request: Request) -> RequestOutput:
        self.scheduler.remove_running(request)
        del self.requests[request.request_id]
        return request.output(request.output_token_ids[-1:])

    def _hand_off(self, request: Request) -> RequestOutput:
        """PREFILL role: keep the prompt's blocks pinned and publish a handle to them."""
        request.finish(RequestStatus.FINISHED_PREFILLED)
        self.scheduler.remove_running(request, free=False)
        del self.requests[request.request_id]
        handle = self.export.hand_off(request)
        return request.output(request.output_token_ids[-1:], handle)

    def cost_model_key(self) -> CostModelKey:
        """What this engine's fitted step costs are saved under (`pdserve profile`): this
        machine's CPU (or GPU), the dtype and the model."""
        device = self.config.device
        if device.startswith("cuda"):
            name = torch.cuda.get_device_name(torch.device(device))
        else:
            name = machine_id()
        return CostModelKey(
            name, str(self.config.torch_dtype).removeprefix("torch."), self.model_id
        )

    def use_step_cost(self, cost: StepCost | None) -> None:
        """Size the prompt chunks of mixed steps by `cost` (the fitted step cost at this
        engine's thread count; `step_budget.py`); None: only max_num_batched_tokens caps them."""
        self.scheduler.step_budget = None if cost is None else StepBudget(cost)

    def between_layers(self, hook: Callable[[], None] | None) -> None:
        """Call `hook` on the stepping thread between every two decoder layers of each step's
        forward (None: no call). It may change the thread's intra-op team (core lending gives
        borrowed CPUs back there, so their owner waits one layer, not one step). Not called in a
        CUDA-graph replay."""
        self.runner.model.between_layers = hook

    @staticmethod
    def num_threads() -> int:
        """The intra-op threads this process's steps run with (torch's, on the CPU)."""
        return torch.get_num_threads()

    # -- prefix cache --------------------------------------------------------------------------

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (for operators and tests); running requests keep their
        blocks. Returns how many block hashes were dropped."""
        return self.kv_cache.pool.reset_prefix_cache()

    def prefix_cache_hashes(self) -> list[BlockHash]:
        """Every block hash the prefix cache holds now (a snapshot for an external index)."""
        return self.kv_cache.pool.cached_hashes()

    def take_kv_events(self) -> list[KVEvent]:
        """Prefix-cache events since the last call, oldest first (empty unless
        `enable_kv_events`)."""
        return self.kv_cache.pool.take_events()

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks held for KV export (PREFILL role), awaiting a pull or their lease."""
        return self.export.num_pinned_blocks

    def check_integrity(self) -> None:
        """Raise RuntimeError if block accounting is broken (tests call it after every step)."""
        pool = self.kv_cache.pool
        pool.check_integrity()
        holders = [
            *self.scheduler.running,
            *self.reservations.reserved,
            *self.pinned.values(),
            *self.remote.abandoned,
        ]
        pool.check_holders(r.block_table for r in holders)
