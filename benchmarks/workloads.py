"""The serving suite's workloads and its rate search, fixed before any run (issue 32).

| workload | prompts / outputs | objective per request |
|---|---|---|
| W1 chat | 256 / 64 | TTFT <= 2x T0(256), mean TPOT <= 1.5x P0 |
| W2 mixed | 85% 256 / 64, 15% 2,048 / 64 (seeded) | TTFT <= 2x T0(own length), TPOT <= 1.5x P0 |
| W3 stall-sensitive | W2's mix | W2's, plus the second-largest token gap <= 3x P0 |
| W4 long | 2,048 / 128 | TTFT <= 2x T0(2,048), mean TPOT <= 1.5x P0 |
| U untuned | 512 / 256 | W1's factors; fixed before tuning, run once at the end |

T0(L) and P0 are the peer's (vLLM's) unloaded TTFT at L prompt tokens and its TPOT, each the
median of requests sent one at a time at the start of the sitting, so the objectives scale with
the machine and are set by the peer.

Goodput is DistServe's (Zhong et al., OSDI 2024): the highest Poisson rate at which at least 90%
of requests meet every objective (`sweep.goodput`: the highest passing rate below the lowest
failing one). `next_rate` searches a geometric grid of GRID_STEP steps from a predicted knee
(`predicted_knee`: the fitted step-cost model, the row's own unloaded TTFT and the TTFT
objective's headroom over it), then bisects the knee geometrically until
the failing rate is within RESOLUTION of the passing one.

No I/O here: `suite.py` runs it, `tests/bench/test_workloads.py` checks it on fake servers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.bench.dataset import Lengths
from services.bench.stats import Slo
from services.bench.sweep import Rated, goodput
from services.cost_model.step_cost import StepCost, StepShape

GRID_STEP = 1.15  # the rate grid's ratio between neighbours
RESOLUTION = 1.10  # the search stops when failing rate / passing rate <= this
FLOOR_RATE = 0.1  # req/s: a system failing here has goodput "< 0.1"
MIN_REQUESTS, MIN_POINT_S = 150, 180.0  # per point, whichever gives more requests
P90_OVER_MEAN_WAIT = 2.3  # an exponential-tailed wait: p90 = ln(10) x the mean
UTILISATION_BOUNDS = (0.05, 0.9)  # where a search may start

W2_MIX = ((0.85, 256, 64), (0.15, 2048, 64))


@dataclass(frozen=True)
class Workload:
    """One row of the suite: what is sent and how its objectives scale from T0 and P0."""

    name: str
    lengths: Lengths
    ttft_factor: float = 2.0  # TTFT <= factor x T0(own prompt length)
    tpot_factor: float = 1.5  # mean TPOT <= factor x P0
    gap_factor: float | None = None  # second-largest token gap <= factor x P0
    tuned: bool = True  # False: the workload fixed in advance and never tuned on

    def shapes(self) -> tuple[tuple[float, int, int], ...]:
        """(weight, prompt tokens, output tokens) of each request kind."""
        if self.lengths.dataset == "mix":
            return self.lengths.mix
        return ((1.0, self.lengths.input_len, self.lengths.output_len),)

    def prompt_lengths(self) -> tuple[int, ...]:
        """The prompt lengths whose unloaded TTFT (T0) the objectives need, ascending."""
        return tuple(sorted({n for _, n, _ in self.shapes()}))

    def objectives(self, t0: Mapping[int, float], p0: float) -> Slo:
        """The per-request objectives from the peer's T0 (seconds by prompt length) and P0
        (seconds). KeyError naming a prompt length with no T0."""
        missing = [n for n in self.prompt_lengths() if n not in t0]
        if missing:
            raise KeyError(f"t0: no unloaded TTFT measured at {missing} prompt tokens")
        return Slo(
            ttft_at=tuple((n, self.ttft_factor * t0[n]) for n in self.prompt_lengths()),
            tpot=self.tpot_factor * p0,
            itl=None if self.gap_factor is None else self.gap_factor * p0,
        )


SUITE = {
    "W1": Workload("W1 chat", Lengths("random", 256, 64)),
    "W2": Workload("W2 mixed", Lengths("mix", mix=W2_MIX)),
    "W3": Workload("W3 stall-sensitive", Lengths("mix", mix=W2_MIX), gap_factor=3.0),
    "W4": Workload("W4 long", Lengths("random", 2048, 128)),
    "U": Workload("U untuned 512/256", Lengths("random", 512, 256), tuned=False),
}


def point_requests(rate: float) -> int:
    """Requests in a point at `rate` req/s: at least MIN_REQUESTS and MIN_POINT_S of arrivals."""
    return max(MIN_REQUESTS, math.ceil(rate * MIN_POINT_S))


def knee_utilisation(objective_s: float, service_s: float) -> float:
    """The utilisation at which a prompt's p90 queueing wait uses up its TTFT headroom
    (`objective_s` - `service_s`, its unloaded TTFT): an M/D/1 queue's mean wait is
    rho * s / (2 (1 - rho)), and its p90 about P90_OVER_MEAN_WAIT times that; kept within
    UTILISATION_BOUNDS."""
    headroom = objective_s - service_s
    low, high = UTILISATION_BOUNDS
    if headroom <= 0:
        return low
    rho = headroom / (headroom + P90_OVER_MEAN_WAIT * service_s / 2)
    return min(max(rho, low), high)


def predicted_knee(
    workload: Workload,
    cost: StepCost | None,
    slo: Slo,
    unloaded_ttft: Mapping[int, float],
    unloaded_tpot_s: float = 0.0,
) -> float:
    """Where a row's search starts (req/s): the utilisation its TTFT headroom allows
    (`knee_utilisation`, from its own unloaded TTFT by prompt length and the objective; the
    tightest of the workload's prompt lengths) over one request's engine seconds on the fitted
    `cost`: its prompt's prefill alone (or its unloaded TTFT, if longer: a prefill worker of
    fewer threads) plus its output tokens at the per-row share of an 8-row decode step. Without
    a fitted cost: its unloaded TTFT, and that share taken as `unloaded_tpot_s` / 8."""
    seconds, rho = 0.0, 1.0
    total = sum(w for w, _, _ in workload.shapes())
    for weight, prompt, output in workload.shapes():
        service, per_row = unloaded_ttft[prompt], unloaded_tpot_s / 8
        if cost is not None:
            service = max(cost.predict(StepShape(chunks=((prompt, 0),))), service)
            context = prompt + output // 2
            per_row = cost.predict(StepShape(decode_contexts=(context,) * 8)) / 8
        seconds += weight / total * (service + output * per_row)
        objective = slo.ttft_for(prompt)
        rho = min(rho, knee_utilisation(math.inf if objective is None else objective, service))
    return rho / seconds


def next_rate(points: Sequence[Rated], start: float) -> float | None:
    """The next rate (req/s) to run for one system, or None when its goodput is settled: within
    RESOLUTION, or below FLOOR_RATE. From `start`, up or down the GRID_STEP grid (three steps
    at a time while attainment is far from the bar: >= 99% going up, < 70% going down), then
    the geometric midpoint of the knee."""
    if not points:
        return start
    found = goodput(points)
    if found.rate is not None and found.resolution is not None:
        failing = found.rate + found.resolution
        if failing / found.rate <= RESOLUTION * (1 + 1e-9):
            return None
        return math.sqrt(found.rate * failing)
    ranked = sorted(points, key=lambda p: p.request_rate)
    if found.rate is not None:  # every point passed: climb
        top, attainment = ranked[-1].request_rate, ranked[-1].attainment
        return top * GRID_STEP ** (3 if (attainment or 0.0) >= 0.99 else 1)
    low, attainment = ranked[0].request_rate, ranked[0].attainment
    if low <= FLOOR_RATE * (1 + 1e-9):
        return None  # goodput < FLOOR_RATE
    rate = low / GRID_STEP ** (1 if (attainment or 0.0) >= 0.7 else 3)
    return max(rate, FLOOR_RATE)
