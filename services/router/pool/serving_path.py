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
  borrows an idle prefill worker's threads and takes the prompt in one step.

Each prediction is scaled by the ratio of observed to predicted first-token times of that path's
recent requests (`PathCalibration`, returning to 1 within seconds without new ones): what the
fitted costs miss, such as a core shared with the router, the hand-over of borrowed threads or
the serving path's own milliseconds, is measured, not modelled. Without a TTFT objective the
prompt goes where its predicted TTFT is lower (local on a tie: it ships no KV). With one (the
request's `x-slo-ttft-ms`, else the router's `--slo-ttft-ms`), of the paths that meet it (the
prediction times the path's calibrated 90% bound, `PathCalibration.upper`: a prediction just
inside the objective misses it as soon as the prompt queues) the prompt takes the one that
delays the decode worker's running streams least (stream-seconds,
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
from collections.abc import Mapping
from dataclasses import dataclass

from services.router.pool.path_calibration import PATHS, PathCalibration
from services.router.pool.path_prediction import (
    PathLoad,
    WorkerView,
    predict_local,
    predict_remote,
    stream_delay,
)

LENDING_LOCAL_PREFILL_TOKENS = 512
"""Without fitted costs, the longest prompt (tokens) prefilled on a decode worker that borrows
the idle prefill CPUs (W1-shaped load, docs/benchmarks.md "Core lending and the local path")."""
MODES = ("mode", "length", "predicted", "objective")
"""Why a path was chosen (the metric's `reason` label): --disaggregation, the length rule, the
lower predicted TTFT, or the least delay to running streams within the TTFT objective."""


@dataclass(frozen=True)
class PathChoice:
    """A prompt's path ("local" | "remote"), why (one of MODES) and, when predicted, each
    path's predicted TTFT (seconds, calibrated), the calibration factor of the chosen path's
    prediction and the decode worker it was predicted on; under a TTFT objective, each path's
    predicted delay to the running streams (stream-seconds); `streaming`: the decode worker had
    running streams (the calibration's state, `DECODE_STATES`)."""

    path: str
    reason: str
    local_s: float | None = None
    remote_s: float | None = None
    scale: float = 1.0
    decode: str | None = None
    local_delay_s: float | None = None
    remote_delay_s: float | None = None
    streaming: bool = False

    def on(self, decode: str) -> PathChoice:
        return dataclasses.replace(self, decode=decode)


@dataclass(frozen=True)
class ServingPaths:
    """The serving-path rule of a router: `disaggregation` ("auto" | "always" | "never"),
    `max_local_prefill_tokens` (`--max-local-prefill-tokens`; None: predicted by cost where the
    workers report fitted costs and lend CPUs, else the length rule's default, see the module
    docstring) and `slo_ttft_ms`, the TTFT objective of a request that sets none (milliseconds;
    `--slo-ttft-ms`; None: the lower predicted TTFT decides)."""

    disaggregation: str = "auto"
    max_local_prefill_tokens: int | None = None
    slo_ttft_ms: float | None = None

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
        ttft_ms: float | None = None,
    ) -> PathChoice:
        """The path of one prompt. `prefill` / `decode`: the workers it would go to (None: not
        known yet, or no such worker); `calibration` scales the predictions and bounds their
        spread (None: a fresh one, the predictions as fitted, `CALIBRATION_SPREAD_PRIOR`);
        `ttft_ms`: the request's TTFT objective (milliseconds; None: `slo_ttft_ms`)."""
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
                calibration = calibration or PathCalibration()
                predicted = {"local": local, "remote": remote}
                scales = {p: calibration.scale(p, load.streaming) for p in PATHS}
                local, remote = local * scales["local"], remote * scales["remote"]
                objective_ms = ttft_ms if ttft_ms is not None else self.slo_ttft_ms
                if objective_ms is not None:
                    upper = {p: calibration.upper(p, load.streaming) for p in PATHS}
                    meets = [p for p in PATHS if predicted[p] * upper[p] * 1000 <= objective_ms]
                    if meets:
                        return _within_objective(
                            load, prefill, decode, local, remote, meets, scales
                        )
                path = "local" if local <= remote else "remote"
                return PathChoice(
                    path, "predicted", local, remote, scale=scales[path], streaming=load.streaming
                )
        if limit is None:
            limit = LENDING_LOCAL_PREFILL_TOKENS if lends else 0
        return PathChoice("local" if load.prompt_tokens <= limit else "remote", "length")


def _within_objective(
    load: PathLoad, prefill: WorkerView, decode: WorkerView, local: float, remote: float,
    meets: list[str], scales: Mapping[str, float],
) -> PathChoice:  # fmt: skip
    """Of the paths that meet the TTFT objective (`meets`: their predictions within the
    calibration's 90% bound), the one delaying the running streams least (local on a tie);
    `local`, `remote`: the calibrated predictions (seconds)."""
    delays = {p: stream_delay(p, prefill, decode, load) for p in PATHS}
    path = min(meets, key=lambda p: (delays[p], p != "local"))
    return PathChoice(
        path, "objective", local, remote, scale=scales[path],
        local_delay_s=delays["local"], remote_delay_s=delays["remote"],
        streaming=load.streaming,
    )  # fmt: skip
