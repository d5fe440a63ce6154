"""What each serving path of a prompt is predicted to cost (seconds), from the workers' fitted
step costs and the router's view of their load: the first token's time on each path
(`predict_local`, `predict_remote`) and the delay each would add to the decode worker's running
streams (`stream_delay`). `serving_path.py` decides by them. Torch-free."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from services.cost_model import store
from services.cost_model.step_cost import StepCost, StepShape
from services.engine.config import EngineConfig
from services.engine.step_budget import StepBudget, default_itl_s


@dataclass(frozen=True)
class WorkerView:
    """What the router knows of one worker's capacity and speed (its GetInfo).

    `costs`: fitted step costs by thread count; `threads`: the worker's own engine threads;
    `lends`: it is on a core ledger (lends idle CPUs, borrows idle ones); `max_num_batched_tokens`
    caps a step's tokens; `slo_itl_s`: the default ITL objective its step budget keeps (seconds;
    None: `default_itl_s` of its running rows' decode step);
    `max_num_seqs`: requests its engine runs at once. (`slo_itl_s` math.inf: no ITL objective,
    `for_stream`.)
    """

    costs: Mapping[int, StepCost] = field(default_factory=dict)
    threads: int = 1
    lends: bool = False
    max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens
    slo_itl_s: float | None = None
    max_num_seqs: int = EngineConfig.max_num_seqs

    @classmethod
    def from_info(cls, config_json: str, step_costs_json: str) -> WorkerView:
        """From a worker's `WorkerInfo.config_json` and `.step_costs_json`; what is missing or
        malformed keeps its default (an older or foreign worker is still routed to)."""
        try:
            costs = store.from_json(step_costs_json)
        except ValueError:
            costs = {}
        try:
            config = json.loads(config_json)
            engine = config["engine"]
            itl_ms = engine.get("slo_itl_ms")
            return cls(
                costs,
                threads=max(int(config["threads"]), 1),
                lends=bool(config.get("core_ledger")),
                max_num_batched_tokens=int(engine["max_num_batched_tokens"]),
                slo_itl_s=None if itl_ms is None else float(itl_ms) / 1000,
                max_num_seqs=int(engine["max_num_seqs"]),
            )
        except (ValueError, KeyError, TypeError):
            return cls(costs)

    def for_stream(self, itl_s: float | None, tpot_s: float | None) -> WorkerView:
        """This worker as a stream stating these objectives (seconds; None: unstated) sees its
        step budget, taking the streams already running there to state the same: the ITL
        objective its chunks keep follows the engine's `stream_itl_s` (its own, else the
        worker's, else none when it states a TPOT objective)."""
        if itl_s is not None:
            return replace(self, slo_itl_s=itl_s)
        if self.slo_itl_s is None and tpot_s is not None:
            return replace(self, slo_itl_s=math.inf)
        return self

    def cost(self, threads: int) -> StepCost | None:
        """The fitted cost at `threads` (else the nearest fitted count below it, else the
        smallest above: a pessimistic guess); None without any fit."""
        if not self.costs:
            return None
        below = [t for t in self.costs if t <= threads]
        return self.costs[max(below) if below else min(self.costs)]


@dataclass(frozen=True)
class PathLoad:
    """One prompt and the router's view of the load on the two workers it could go to.

    `prompt_tokens`: the prompt (with tokens already streamed, after a migration);
    `prefill_cached`: of them, those the prefill worker's prefix cache holds (the index's guess);
    `prefill_queued`: prompt tokens queued on that prefill worker by this router;
    `decode_rows` / `decode_context`: streams running on the decode worker and their summed
    context (tokens); `local_queued`: prompt tokens of local prefills not yet done there;
    `decode_cached`: prompt tokens the decode worker's prefix cache holds (the index's guess).
    """

    prompt_tokens: int
    prefill_cached: int = 0
    prefill_queued: int = 0
    decode_rows: int = 0
    decode_context: int = 0
    local_queued: int = 0
    decode_cached: int = 0

    @property
    def streaming(self) -> bool:
        """The decode worker has running streams (the state `PathCalibration` keeps apart)."""
        return self.decode_rows > 0


def predict_remote(prefill: WorkerView, decode: WorkerView, load: PathLoad) -> float | None:
    """Predicted seconds until the prefill worker has the prompt's first token (its CPU back
    from a decode worker borrowing it, the queue ahead, then the uncached tokens); None without
    fitted costs."""
    plan = _remote_plan(prefill, decode, load)
    if plan is None:
        return None
    queue, _ = _chunked(plan, load.prefill_queued, 0, ())
    local = _local_plan(prefill, decode, load)
    reclaim = _in_flight_s(local.cost, load) if local is not None and local.borrows else 0.0
    return reclaim + queue + _remote_prompt_s(plan, load)


def predict_local(prefill: WorkerView, decode: WorkerView, load: PathLoad) -> float | None:
    """Predicted seconds until the decode worker has the prompt's first token (the step in
    flight, the local prefills ahead, then the prompt in chunks beside its running streams; see
    the module docstring); None without fitted costs."""
    plan = _local_plan(prefill, decode, load)
    if plan is None:
        return None
    queue, _ = _chunked(plan, load.local_queued, 0, _contexts(load), decode.slo_itl_s)
    own, _ = _local_prompt(plan, decode, load)
    return _in_flight_s(plan.cost, load) + queue + own


def stream_delay(path: str, prefill: WorkerView, decode: WorkerView, load: PathLoad) -> float:
    """Predicted delay (seconds summed over the decode worker's running streams) that
    prefilling the prompt on `path` adds to those streams; 0.0 without streams or fitted costs.

    local: each step carrying one of the prompt's chunks (`predict_local`'s chunking) takes
    longer than the decode-only step it replaces, for every stream. remote: only while the
    decode worker borrows the idle prefill worker's threads (both lend, nothing queued there)
    does the prompt cost the streams anything: for its remote prefill (`predict_remote`'s) the
    prefill worker takes its threads back, and each decode step runs on the decode worker's own
    threads instead."""
    rows = load.decode_rows
    local = _local_plan(prefill, decode, load)
    if not rows or local is None:
        return 0.0
    decode_step = local.cost.predict(StepShape(decode_contexts=_contexts(load)))
    if path == "local":
        seconds, steps = _local_prompt(local, decode, load)
        return rows * max(seconds - steps * decode_step, 0.0)
    own = decode.cost(decode.threads)
    remote = _remote_plan(prefill, decode, load)
    if not local.borrows or own is None or remote is None:
        return 0.0
    slower = own.predict(StepShape(decode_contexts=_contexts(load)))
    return rows * _remote_prompt_s(remote, load) * max(1.0 - decode_step / slower, 0.0)


@dataclass(frozen=True)
class _Plan:
    """How one worker would compute a prompt: its fitted `cost` at the threads it would hold
    (its own, plus another worker's when it `borrows` them), `cap` tokens a step."""

    cost: StepCost
    cap: int
    borrows: bool


def _remote_plan(prefill: WorkerView, decode: WorkerView, load: PathLoad) -> _Plan | None:
    """The prefill worker's plan for the prompt: on its own threads plus the decode worker's
    when that one is idle and both lend; None without fitted costs."""
    borrows = prefill.lends and decode.lends and not load.streaming and not load.local_queued
    threads = prefill.threads + (decode.threads if borrows else 0)
    cost = prefill.cost(threads) or decode.cost(threads)  # one machine: one fitted file
    if cost is None:
        return None
    return _Plan(cost, prefill.max_num_batched_tokens, bool(borrows))


def _remote_prompt_s(plan: _Plan, load: PathLoad) -> float:
    """Predicted seconds of the prompt's uncached tokens on the prefill worker."""
    uncached = max(load.prompt_tokens - load.prefill_cached, 1)
    seconds, _ = _chunked(plan, uncached, load.prefill_cached, ())
    return seconds


def _local_plan(prefill: WorkerView, decode: WorkerView, load: PathLoad) -> _Plan | None:
    """The decode worker's plan for the prompt: on its own threads plus the idle prefill
    worker's when both lend and nothing is queued there; None without fitted costs."""
    borrows = decode.lends and prefill.lends and load.prefill_queued == 0
    threads = decode.threads + (prefill.threads if borrows else 0)
    cost = decode.cost(threads)
    if cost is None:
        return None
    return _Plan(cost, decode.max_num_batched_tokens, bool(borrows))


def _local_prompt(plan: _Plan, decode: WorkerView, load: PathLoad) -> tuple[float, int]:
    """Predicted seconds and steps of the prompt's tokens past the decode worker's cached
    prefix, in chunks beside its running streams."""
    cached = min(load.decode_cached, load.prompt_tokens - 1)  # the last token is always run
    tokens = load.prompt_tokens - cached
    return _chunked(plan, tokens, cached, _contexts(load), decode.slo_itl_s)


def _in_flight_s(cost: StepCost, load: PathLoad) -> float:
    """Expected seconds left of the decode worker's step in flight when the prompt arrives (half
    a decode-only step of its running rows; 0.0 with none): a local prompt joins the next step,
    and a remote one waits for it too while the decode worker computes on the prefill worker's
    borrowed CPU (the prefill worker takes it back between steps)."""
    contexts = _contexts(load)
    return cost.predict(StepShape(decode_contexts=contexts)) / 2 if contexts else 0.0


def _contexts(load: PathLoad) -> tuple[int, ...]:
    """The decode worker's running rows, each given the mean context (tokens)."""
    rows = load.decode_rows
    return (max(load.decode_context // rows, 1),) * rows if rows else ()


def _chunked(
    plan: _Plan,
    tokens: int,
    cached: int,
    contexts: tuple[int, ...],
    itl_s: float | None = math.inf,
) -> tuple[float, int]:
    """Predicted seconds and steps to prefill `tokens` after `cached` as `plan`'s worker would:
    chunks of at most its cap, each step carrying decode rows of `contexts` predicted within
    `itl_s` (None: `default_itl_s` of those rows), each chunk sized at its own position as the
    engine's step budget sizes it."""
    if tokens <= 0:
        return 0.0, 0
    budget = StepBudget(plan.cost)
    limit = math.inf
    if contexts:
        limit = default_itl_s(budget.decode_step_s(contexts)) if itl_s is None else itl_s
    total, done, steps = 0.0, 0, 0
    while done < tokens:
        chunk = budget.prefill_tokens(contexts, cached + done, limit, max(plan.cap, 1))
        n = min(max(chunk, 1), tokens - done)
        shape = StepShape(chunks=((n, cached + done),), decode_contexts=contexts)
        total += plan.cost.predict(shape)
        done += n
        steps += 1
    return total, steps
