"""The per-step token budget: how many prompt tokens a step may add to the running decodes.

A step that mixes a prefill chunk into decode rows delays every one of those streams' next
token by the whole step. Sarathi-Serve (Agrawal et al., OSDI 2024) caps such steps with a fixed
token budget; SLOs-Serve (2025) derives the budget from the streams' objectives. Here each step
takes the largest chunk whose predicted step time (the cost model fitted on this machine,
`services/cost_model/`) fits the tightest allowance among the streams it carries (`allowed_step_s`:
a stream's ITL objective, shortened to its TPOT slack), recomputed every step;
`--max-num-batched-tokens` stays a cap. A step without decode rows delays nobody and takes the
cap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.cost_model.step_cost import StepCost, StepShape
from services.cost_model.step_log import shape_of

MIN_CHUNK_TOKENS = 16  # a prompt always advances, even when a decode step alone misses the ITL

ITL_DECODE_STEPS = 5.0
"""The ITL objective of a stream that brings none, where the engine sets none either
(`--slo-itl-ms`): this many times the predicted decode-only step of the rows running now.
Sarathi-Serve (Agrawal et al., OSDI 2024) sets its strict P99 time-between-tokens objective at
5x a decode iteration; an objective relative to the machine's own decode step keeps a prompt
beside running streams from stretching their gaps beyond a few steps on any CPU or GPU, where
a fixed 250 ms let 2,048-token prompts stretch them 5.8x (docs/benchmarks.md, 2026-12-07)."""


def default_itl_s(decode_step_s: float) -> float:
    """The ITL objective (seconds) of a stream without one when the engine sets none:
    `ITL_DECODE_STEPS` x `decode_step_s`, the predicted decode-only step of the running rows."""
    return ITL_DECODE_STEPS * decode_step_s


TPOT_HORIZON_TOKENS = 16
"""How many of a stream's coming tokens may lend their projected TPOT slack to a step now, at
least (a stream that has made more tokens than this counts as many coming as it has made, up
to what max_tokens leaves): a mean-TPOT objective is met over the whole output, so a stream
whose decode steps run faster than its objective can absorb a longer step early. Capped because
a stream may stop before max_tokens (EOS, a stop string) and never earn the rest; a stream that
has run long is taken to run about as long again."""


def allowed_step_s(
    itl_s: float,
    tpot_s: float,
    first_token_at: float | None,
    num_output_tokens: int,
    now: float,
    remaining_tokens: int = 0,
    decode_step_s: float = 0.0,
) -> float:
    """The longest step (seconds) one running stream allows now: its ITL objective `itl_s`,
    shortened to its TPOT slack, never below `tpot_s` (a stream that is behind is held at one
    objective a step). The slack is the time left before its mean TPOT objective `tpot_s`
    would be missed by the token this step makes (first token at `first_token_at`,
    `num_output_tokens` tokens so far, `now` in the same clock), plus what its next
    min(`remaining_tokens`, max(TPOT_HORIZON_TOKENS, `num_output_tokens`)) tokens are projected
    to save, each at `decode_step_s` (a decode step without a chunk) against `tpot_s`. A
    stream ahead of its TPOT lends the rest to a prefill chunk, as SLOs-Serve (2025) plans by
    slack. Before its first token: `itl_s`, or `tpot_s` when that is math.inf (no ITL
    objective)."""
    if first_token_at is None:
        return itl_s if math.isfinite(itl_s) else tpot_s
    slack = first_token_at + tpot_s * num_output_tokens - now
    coming = max(0, min(remaining_tokens, max(TPOT_HORIZON_TOKENS, num_output_tokens)))
    slack += max(0.0, tpot_s - decode_step_s) * coming
    return min(itl_s, max(slack, tpot_s))


def asked_itl_s(objectives: Any, itl_s: float | None) -> float | None:
    """The ITL objective (seconds) asked for a stream with `objectives`: its own, else the
    engine's `itl_s` (`--slo-itl-ms`); None when neither asked one."""
    return itl_s if objectives.itl_s is None else float(objectives.itl_s)


def stream_itl_s(objectives: Any, itl_s: float | None, decode_step_s: float) -> float:
    """A stream's ITL objective (seconds) for the step budget: the one asked for
    (`asked_itl_s`); else none (math.inf) when the stream states a TPOT objective without an
    ITL one (llm-d's x-slo-ttft-ms / x-slo-tpot-ms: its client said what it needs, and its
    TPOT slack alone bounds the step); else `default_itl_s` of `decode_step_s`."""
    asked = asked_itl_s(objectives, itl_s)
    if asked is not None:
        return asked
    if objectives.tpot_s is not None:
        return math.inf
    return default_itl_s(decode_step_s)


def streams_allow_s(
    decodes: Sequence[Any], decode_step_s: float, itl_s: float | None, tpot_s: float, now: float
) -> float:
    """The longest step (seconds) every stream of `decodes` (the engine's running `Request`s
    that decode in it) allows: `allowed_step_s` of each, by `stream_itl_s` and its own TPOT
    objective or the engine's `tpot_s`; `decode_step_s` is the rows' predicted decode-only
    step."""
    return min(
        allowed_step_s(
            stream_itl_s(r.objectives, itl_s, decode_step_s),
            tpot_s if r.objectives.tpot_s is None else r.objectives.tpot_s,
            r.first_token_time,
            r.num_output_tokens,
            now,
            remaining_tokens=r.sampling_params.max_tokens - r.num_output_tokens - 1,
            decode_step_s=decode_step_s,
        )
        for r in decodes
    )


def prompt_deadline_s(
    budget: StepBudget, prompt: Any, cached: int, decodes: Sequence[Any],
    contexts: Sequence[int], itl_s: float | None, cap: int, now: float,
) -> float:  # fmt: skip
    """The step (seconds) `prompt` (a `Request` with a TTFT objective, `cached` of its tokens
    computed) needs beside the rows of `decodes` (their contexts `contexts`) to meet its
    objective (`StepBudget.deadline_step_s`, at most `cap` tokens a step), within every
    stream's ITL objective that was asked for (`asked_itl_s`, the engine's `itl_s`): a
    prompt's deadline outweighs the streams' TPOT slack and the ITL default, never an ITL
    objective. 0.0 when the deadline is lost."""
    left = prompt.arrival_time + prompt.objectives.ttft_s - now
    need = budget.deadline_step_s(
        contexts, prompt.num_tokens - cached, cached, left, cap - len(decodes)
    )
    asked = (asked_itl_s(r.objectives, itl_s) for r in decodes)
    return min([need, *(a for a in asked if a is not None)])


def worth_packing(
    budget: StepBudget,
    step_rows: Sequence[tuple[int, int]],
    chunk: tuple[int, int],
    behind: int,
    completes: bool = True,
) -> bool:
    """Whether the next waiting prompt's `chunk` ((tokens, cached before them)) should join a
    step whose rows are already `step_rows` ((tokens, start position) each; one-token rows are
    decodes) rather than start the next step, with `behind` prompts waiting after it;
    `completes`: the chunk is the rest of its prompt.

    Packing saves the prompt the fixed part of a step of its own, `s` = the chunk's predicted
    seconds alone - `d`, its marginal seconds in this step; it costs each of the step's `k`
    prompt rows `d` seconds of TTFT. The prompts behind it save `s` each, since the queue drains
    one step sooner. So it joins iff k * d < (1 + behind) * s: the exchange argument for the sum of
    completion times on one machine with a setup cost per batch (Potts and Kovalyov, "Scheduling
    with batching: a review", EJOR 2000). Where a prompt's compute dwarfs a step's fixed part,
    as a CPU's prefill of a few hundred tokens does, each prompt gets its own step and the first
    one's TTFT no longer waits for the others' (docs/benchmarks.md, issue 32's eleventh sitting);
    tiny prompts, or a long queue, still share a step. A step with no prompt rows yet always
    takes it; a chunk that leaves part of its prompt for a later step saves nobody a step, so
    it joins only such a step."""
    prompts = sum(1 for n, _ in step_rows if n > 1)
    if not prompts:
        return True
    if not completes:
        return False
    rows = shape_of(step_rows)
    with_chunk = StepShape(chunks=(*rows.chunks, chunk), decode_contexts=rows.decode_contexts)
    marginal = budget.cost.predict(with_chunk) - budget.cost.predict(rows)
    saved = budget.cost.predict(StepShape(chunks=(chunk,))) - marginal
    return prompts * marginal < (1 + behind) * saved


LIVE_SCALE_WEIGHT = 0.1
"""Weight of one observed mixed step in `LiveScale`'s running ratio (about the last 10 steps)."""
LIVE_SCALE_BOUNDS = (0.5, 3.0)
"""Least and most `LiveScale` ratio: one wild step (a page fault storm, a paused process) moves
it a bounded step, and no history makes the budget ignore the fitted model altogether."""


@dataclass
class LiveScale:
    """Observed over predicted seconds of this engine's recent mixed steps (a chunk beside decode
    rows), per thread count: an exponentially weighted ratio that scales the budget's predictions.

    The fitted model (`pdserve profile`) times steps on a quiet machine; served, a step shares its
    cores with the worker's gRPC threads, the router and the clients, and runs 1.2-1.4x longer on
    two threads of a 2-core EPYC (docs/benchmarks.md, 2026-12-07). The budget keeps the streams'
    ITL only if it predicts the steps as they run here, so it learns the ratio from the steps it
    sized, as the router's `PathCalibration` does from first tokens."""

    weight: float = LIVE_SCALE_WEIGHT
    """Of one observed step (0.0: the ratio stays 1, the model as fitted)."""
    ratios: dict[int, float] = field(default_factory=dict)

    def ratio(self, threads: int) -> float:
        """The current ratio at `threads` (1.0 before any mixed step ran at that count)."""
        return self.ratios.get(threads, 1.0)

    def observe(self, threads: int, predicted_s: float, observed_s: float) -> None:
        """Fold one mixed step in (ignored without a positive prediction and observation)."""
        if not (predicted_s > 0 and observed_s > 0):
            return
        low, high = LIVE_SCALE_BOUNDS
        sample = min(max(observed_s / predicted_s, low), high)
        now = self.ratio(threads)
        self.ratios[threads] = now + self.weight * (sample - now)

    def observe_step(self, cost: StepCost, rows: Sequence[tuple[int, int]], seconds: float) -> None:
        """Fold in one engine step of `rows` ((tokens, start position) each) that took `seconds`,
        predicted by `cost`, when it was a mixed step (a prompt chunk beside decode rows)."""
        shape = shape_of(rows) if rows else None
        if shape is not None and shape.chunks and shape.decode_contexts:
            self.observe(cost.threads, cost.predict(shape), seconds)


@dataclass(frozen=True)
class StepBudget:
    """`cost`: the fitted step cost at the engine's thread count."""

    cost: StepCost
    min_chunk_tokens: int = MIN_CHUNK_TOKENS

    def decode_step_s(self, decode_contexts: Sequence[int]) -> float:
        """Predicted seconds of a step of these decode rows alone (no chunk; 0.0 without rows)."""
        if not decode_contexts:
            return 0.0
        return self.cost.predict(StepShape(decode_contexts=tuple(decode_contexts)))

    def deadline_step_s(
        self, decode_contexts: Sequence[int], tokens: int, cached: int, time_left_s: float, cap: int
    ) -> float:
        """The shortest step (seconds) that still lets a prompt's remaining `tokens` (after
        `cached`) reach its first token within `time_left_s`, cut into equal chunks of at most
        `cap` beside decode rows of `decode_contexts`: the predicted step of the chunk that
        takes the most steps still in time (each chunk costed at the prompt's middle position).
        0.0 when even the fewest steps miss it (the deadline is lost: the streams keep their
        allowance). SLOs-Serve (2025) plans prefill deadlines against decode slack the same
        way, over a whole schedule."""
        if tokens <= 0 or time_left_s <= 0 or cap <= 0:
            return 0.0
        decodes = tuple(decode_contexts)

        def chunk(steps: int) -> int:
            return math.ceil(tokens / steps)

        def total_s(steps: int) -> float:
            n = chunk(steps)
            middle = cached + (tokens - n) // 2
            return steps * self.cost.predict(StepShape(((n, middle),), decodes))

        low, high = math.ceil(tokens / cap), max(math.ceil(tokens / self.min_chunk_tokens), 1)
        if total_s(low) > time_left_s:
            return 0.0
        while low < high:  # more steps take longer in all (each pays the fixed cost): bisect
            middle = (low + high + 1) // 2
            low, high = (middle, high) if total_s(middle) <= time_left_s else (low, middle - 1)
        return self.cost.predict(StepShape(((chunk(low), cached),), decodes))

    def prefill_tokens(
        self, decode_contexts: Sequence[int], cached: int, step_s: float, cap: int
    ) -> int:
        """The most prompt tokens (at most `cap`, at least min(cap, min_chunk_tokens)) a step
        with `decode_contexts` (each decode row's context, tokens; none is fine) may compute,
        as one chunk after `cached` tokens, for its predicted seconds to stay within `step_s`
        (math.inf: `cap`)."""
        if math.isinf(step_s) or cap <= self.min_chunk_tokens:
            return max(cap, 0)
        decodes = tuple(decode_contexts)

        def fits(n: int) -> bool:
            shape = StepShape(chunks=((n, cached),), decode_contexts=decodes)
            return self.cost.predict(shape) <= step_s

        low, high = self.min_chunk_tokens, cap  # fits(low) is assumed; find the largest that fits
        if fits(high):
            return high
        while high - low > 1:  # predicted time grows with n: bisect
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        return low
