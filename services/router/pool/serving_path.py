"""Which path a prompt takes under `--disaggregation auto`: prefilled on its decode worker
("local") or on the prefill pool ("remote"), by the TTFT each path is predicted to give.

Each worker reports the step costs fitted on its machine (`WorkerInfo.step_costs_json`,
`services/cost_model/`), its thread count and whether it lends CPUs (`core_lending.py`). The
router adds what it has in flight on each worker: prompt tokens queued on the prefill worker,
decode streams and their context on the decode worker, local prefills not yet done there. From
these it predicts (seconds):

- remote: the prefill worker computes what is queued ahead of the prompt, then the prompt's
  tokens past its cached prefix, on its own threads plus the decode worker's when that one is
  idle and lends them;
- local: the decode worker computes the local prefills ahead, then the prompt's tokens past its
  cached prefix in chunks. With
  streams running each chunk is the largest whose step keeps the ITL objective (the engine's own
  `StepBudget`, on the same fitted cost), and every step carries the running rows; with none it
  borrows an idle prefill worker's threads, a step taking at most `BORROWED_STEP_TOKENS`.

Each prediction is scaled by the ratio of observed to predicted first-token times of that path's
recent requests (`PathCalibration`, returning to 1 within seconds without new ones): what the
fitted costs miss, such as a core shared with the router, the hand-over of borrowed threads or
the serving path's own milliseconds, is measured, not modelled. Without a TTFT objective the
prompt goes where its predicted TTFT is lower (local on a tie: it ships no KV). With one (the
request's `x-slo-ttft-ms`, else the router's `--slo-ttft-ms`), of the paths predicted to meet it
the prompt takes the one that delays the decode worker's running streams least (stream-seconds,
`stream_delay`): local, its chunks lengthen those streams' steps; remote, when the decode
worker is borrowing the idle prefill worker's CPUs, the prefill worker takes them back for the
prompt and the streams' steps run on the decode worker's own. TaiChi (2025) and DistServe place
work by the objectives in this way: the prompt's TTFT objective bounds its choice, the running
streams' TPOT decides it. Neither path meeting it, the lower TTFT wins. This is conditional
disaggregation by load and cache (Dynamo's disaggregated router and Splitwise's mixed pool
decide by prefill length and queue; llm-d by uncached tokens), with the decision predicted from
measured step costs rather than a fixed threshold. Without fitted costs the rule is the prompt
length: at most `max_local_prefill_tokens` tokens local (None: `LENDING_LOCAL_PREFILL_TOKENS`
when the decode worker lends CPUs, else 0).

Both predictions count only the tokens past the prompt's cached prefix on that worker, from the
prefix index (exact with Redis, where every worker publishes its cache; else the router's record
of where it sent each prompt, decode workers included: a decode worker keeps the prompts it
streamed). So a follow-up turn whose history the decode worker holds prefills its few new tokens
there. Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from services.cost_model import store
from services.cost_model.step_cost import StepCost, StepShape
from services.engine.config import EngineConfig
from services.engine.step_budget import BORROWED_STEP_TOKENS, StepBudget

LENDING_LOCAL_PREFILL_TOKENS = 512
"""Without fitted costs, the longest prompt (tokens) prefilled on a decode worker that borrows
the idle prefill CPUs (W1-shaped load, docs/benchmarks.md "Core lending and the local path")."""
MODES = ("mode", "length", "predicted", "objective")
"""Why a path was chosen (the metric's `reason` label): --disaggregation, the length rule, the
lower predicted TTFT, or the least delay to running streams within the TTFT objective."""
PATHS = ("local", "remote")
CALIBRATION_WEIGHT = 0.2
"""Weight of the newest observation in `PathCalibration`'s exponentially weighted ratio."""
CALIBRATION_BOUNDS = (0.5, 4.0)
"""The range a path's observed / predicted ratio is kept in (one outlier cannot flip a path)."""
CALIBRATION_DECAY_S = 10.0
"""Time constant (seconds) over which a path's ratio returns to 1.0 without new observations: a
path judged slow under a burst is chosen less, so it would otherwise keep the burst's ratio
long after the burst (measured: under the suite's quick W1 check, after a point past the knee
the local path's ratio sent half of a lighter point's prompts to a one-core prefill worker
whose TTFT missed the objective)."""


@dataclass(frozen=True)
class WorkerView:
    """What the router knows of one worker's capacity and speed (its GetInfo).

    `costs`: fitted step costs by thread count; `threads`: the worker's own engine threads;
    `lends`: it is on a core ledger (lends idle CPUs, borrows idle ones); `max_num_batched_tokens`
    caps a step's tokens; `slo_itl_s`: the default ITL objective its step budget keeps (seconds);
    `max_num_seqs`: requests its engine runs at once.
    """

    costs: Mapping[int, StepCost] = field(default_factory=dict)
    threads: int = 1
    lends: bool = False
    max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens
    slo_itl_s: float = EngineConfig.slo_itl_ms / 1000
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
            return cls(
                costs,
                threads=max(int(config["threads"]), 1),
                lends=bool(config.get("core_ledger")),
                max_num_batched_tokens=int(engine["max_num_batched_tokens"]),
                slo_itl_s=float(engine["slo_itl_ms"]) / 1000,
                max_num_seqs=int(engine["max_num_seqs"]),
            )
        except (ValueError, KeyError, TypeError):
            return cls(costs)

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


@dataclass(frozen=True)
class PathChoice:
    """A prompt's path ("local" | "remote"), why (one of MODES) and, when predicted, each
    path's predicted TTFT (seconds, calibrated), the calibration factor of the chosen path's
    prediction and the decode worker it was predicted on; under a TTFT objective, each path's
    predicted delay to the running streams (stream-seconds)."""

    path: str
    reason: str
    local_s: float | None = None
    remote_s: float | None = None
    scale: float = 1.0
    decode: str | None = None
    local_delay_s: float | None = None
    remote_delay_s: float | None = None

    def on(self, decode: str) -> PathChoice:
        return dataclasses.replace(self, decode=decode)


class PathCalibration:
    """Observed over predicted seconds to the first token, per path, as an exponentially
    weighted mean (`CALIBRATION_WEIGHT`, kept within `CALIBRATION_BOUNDS`; 1.0 until a path's
    first observation) that decays back to 1.0 between observations (`CALIBRATION_DECAY_S`).
    One per router; thread-safe. `clock`: seconds (time.monotonic)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._ratio = dict.fromkeys(PATHS, 1.0)
        self._at = dict.fromkeys(PATHS, 0.0)  # when each ratio was last set

    def observe(self, path: str, predicted_s: float, observed_s: float) -> None:
        """One request's `path` ("local" | "remote") was predicted to reach its first token in
        `predicted_s` and did in `observed_s` seconds. Raises ValueError for another path."""
        if path not in self._ratio:
            raise ValueError(f"path: expected one of {PATHS}, got {path!r}")
        if predicted_s <= 0 or observed_s <= 0:
            return
        low, high = CALIBRATION_BOUNDS
        ratio = min(max(observed_s / predicted_s, low), high)
        with self._lock:
            now = self._clock()
            old = self._decayed(path, now)
            self._ratio[path] = old + CALIBRATION_WEIGHT * (ratio - old)
            self._at[path] = now

    def scale(self, path: str) -> float:
        """The factor `path`'s predictions are multiplied by."""
        with self._lock:
            return self._decayed(path, self._clock())

    def _decayed(self, path: str, now: float) -> float:
        weight = math.exp(-max(now - self._at[path], 0.0) / CALIBRATION_DECAY_S)
        return 1.0 + (self._ratio[path] - 1.0) * weight


def predict_remote(prefill: WorkerView, decode: WorkerView, load: PathLoad) -> float | None:
    """Predicted seconds until the prefill worker has the prompt's first token (the queue ahead,
    then the uncached tokens); None without fitted costs."""
    borrows = prefill.lends and decode.lends and load.decode_rows == 0 and not load.local_queued
    threads = prefill.threads + (decode.threads if borrows else 0)
    cost = prefill.cost(threads) or decode.cost(threads)  # one machine: one fitted file
    if cost is None:
        return None
    cap = BORROWED_STEP_TOKENS if borrows else prefill.max_num_batched_tokens
    uncached = max(load.prompt_tokens - load.prefill_cached, 1)
    queue, _ = _chunked(cost, load.prefill_queued, 0, cap, ())
    own, _ = _chunked(cost, uncached, load.prefill_cached, cap, ())
    return queue + own


def predict_local(prefill: WorkerView, decode: WorkerView, load: PathLoad) -> float | None:
    """Predicted seconds until the decode worker has the prompt's first token, computed in
    chunks beside its running streams (see the module docstring); None without fitted costs."""
    borrows = decode.lends and prefill.lends and load.prefill_queued == 0
    threads = decode.threads + (prefill.threads if borrows else 0)
    cost = decode.cost(threads)
    if cost is None:
        return None
    cap = min(decode.max_num_batched_tokens, BORROWED_STEP_TOKENS if borrows else math.inf)
    contexts = _contexts(load)
    queue, _ = _chunked(cost, load.local_queued, 0, int(cap), contexts, decode.slo_itl_s)
    cached = min(load.decode_cached, load.prompt_tokens - 1)  # the last token is always run
    own, _ = _chunked(
        cost, load.prompt_tokens - cached, cached, int(cap), contexts, decode.slo_itl_s
    )
    return queue + own


def stream_delay(path: str, prefill: WorkerView, decode: WorkerView, load: PathLoad) -> float:
    """Predicted delay (seconds summed over the decode worker's running streams) that
    prefilling the prompt on `path` adds to those streams; 0.0 without streams or fitted costs.

    local: each step carrying one of the prompt's chunks (`predict_local`'s chunking) takes
    longer than the decode-only step it replaces, for every stream. remote: only while the
    decode worker borrows the idle prefill worker's threads (both lend, nothing queued there)
    does the prompt cost the streams anything: for its remote prefill the prefill worker takes
    its threads back, and each decode step runs on the decode worker's own threads instead."""
    rows = load.decode_rows
    if not rows:
        return 0.0
    contexts = _contexts(load)
    borrows = decode.lends and prefill.lends and load.prefill_queued == 0
    threads = decode.threads + (prefill.threads if borrows else 0)
    cost = decode.cost(threads)
    if cost is None:
        return 0.0
    decode_step = cost.predict(StepShape(decode_contexts=contexts))
    if path == "local":
        cap = min(decode.max_num_batched_tokens, BORROWED_STEP_TOKENS if borrows else math.inf)
        cached = min(load.decode_cached, load.prompt_tokens - 1)
        tokens = load.prompt_tokens - cached
        seconds, steps = _chunked(cost, tokens, cached, int(cap), contexts, decode.slo_itl_s)
        return rows * max(seconds - steps * decode_step, 0.0)
    own = decode.cost(decode.threads)
    prefill_cost = prefill.cost(prefill.threads) or own
    if not borrows or own is None or prefill_cost is None:
        return 0.0
    uncached = max(load.prompt_tokens - load.prefill_cached, 1)
    remote, _ = _chunked(
        prefill_cost, uncached, load.prefill_cached, prefill.max_num_batched_tokens, ()
    )
    slower = own.predict(StepShape(decode_contexts=contexts))
    return rows * remote * max(1.0 - decode_step / slower, 0.0)


def _contexts(load: PathLoad) -> tuple[int, ...]:
    """The decode worker's running rows, each given the mean context (tokens)."""
    rows = load.decode_rows
    return (max(load.decode_context // rows, 1),) * rows if rows else ()


def _chunked(
    cost: StepCost,
    tokens: int,
    cached: int,
    cap: int,
    contexts: tuple[int, ...],
    itl_s: float = math.inf,
) -> tuple[float, int]:
    """Predicted seconds and steps to prefill `tokens` after `cached` in chunks of at most
    `cap`, each step also carrying decode rows of `contexts` (then a chunk keeps `itl_s`, as the
    engine's step budget sizes it; the first chunk's size serves for all)."""
    if tokens <= 0:
        return 0.0, 0
    chunk = max(cap, 1)
    if contexts:
        chunk = StepBudget(cost).prefill_tokens(contexts, cached, itl_s, chunk)
    total, done, steps = 0.0, 0, 0
    while done < tokens:
        n = min(chunk, tokens - done)
        total += cost.predict(StepShape(chunks=((n, cached + done),), decode_contexts=contexts))
        done += n
        steps += 1
    return total, steps


@dataclass(frozen=True)
class ServingPaths:
    """The serving-path rule of a router: `disaggregation` ("auto" | "always" | "never"),
    `max_local_prefill_tokens` (`--max-local-prefill-tokens`; None: predicted by cost where the
    workers report fitted costs and lend CPUs, else the length rule's default, see the module
    docstring) and `slo_ttft_s`, the TTFT objective of a request that sets none (seconds;
    `--slo-ttft-ms`; None: the lower predicted TTFT decides)."""

    disaggregation: str = "auto"
    max_local_prefill_tokens: int | None = None
    slo_ttft_s: float | None = None

    def describe(self, lends: bool) -> str:
        """The rule in words, for `pdserve serve`'s log (`lends`: the workers lend CPUs)."""
        line = f"--disaggregation {self.disaggregation}"
        limit = self.max_local_prefill_tokens
        if self.disaggregation != "auto":
            return line
        if limit is None and lends:
            return (
                f"{line}: each prompt where its predicted TTFT is lower, on its decode worker or "
                "the prefill pool (the workers' fitted step costs; without them, prompts of at "
                f"most {LENDING_LOCAL_PREFILL_TOKENS} tokens on the decode worker)"
            )
        if not limit:
            return f"{line}: every prompt prefilled on the prefill pool (no core lending)"
        return f"{line}: prompts of at most {limit} tokens prefilled on their decode worker"

    def choose(
        self,
        load: PathLoad,
        prefill: WorkerView | None,
        decode: WorkerView | None,
        calibration: PathCalibration | None = None,
        ttft_s: float | None = None,
    ) -> PathChoice:
        """The path of one prompt. `prefill` / `decode`: the workers it would go to (None: not
        known yet, or no such worker); `calibration` scales the predictions (None: as fitted);
        `ttft_s`: the request's TTFT objective (seconds; None: `slo_ttft_s`)."""
        if self.disaggregation == "never":
            return PathChoice("local", "mode")
        if self.disaggregation == "always":
            return PathChoice("remote", "mode")
        lends = decode is not None and decode.lends
        limit = self.max_local_prefill_tokens
        if limit is None and lends and prefill is not None and decode is not None:
            local = predict_local(prefill, decode, load)
            remote = predict_remote(prefill, decode, load)
            if local is not None and remote is not None:
                scales = {p: calibration.scale(p) if calibration else 1.0 for p in PATHS}
                local, remote = local * scales["local"], remote * scales["remote"]
                objective = ttft_s if ttft_s is not None else self.slo_ttft_s
                if objective is not None and min(local, remote) <= objective:
                    return _within_objective(
                        load, prefill, decode, local, remote, objective, scales
                    )
                path = "local" if local <= remote else "remote"
                return PathChoice(path, "predicted", local, remote, scale=scales[path])
        if limit is None:
            limit = LENDING_LOCAL_PREFILL_TOKENS if lends else 0
        return PathChoice("local" if load.prompt_tokens <= limit else "remote", "length")


def _within_objective(
    load: PathLoad, prefill: WorkerView, decode: WorkerView, local: float, remote: float,
    objective: float, scales: Mapping[str, float],
) -> PathChoice:  # fmt: skip
    """Of the paths whose predicted TTFT (`local`, `remote`: calibrated seconds) meets
    `objective`, the one delaying the running streams least (local on a tie)."""
    delays = {p: stream_delay(p, prefill, decode, load) for p in PATHS}
    meets = [p for p, t in (("local", local), ("remote", remote)) if t <= objective]
    path = min(meets, key=lambda p: (delays[p], p != "local"))
    return PathChoice(
        path, "objective", local, remote, scale=scales[path],
        local_delay_s=delays["local"], remote_delay_s=delays["remote"],
    )  # fmt: skip
