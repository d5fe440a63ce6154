"""The figures of one benchmark point, from each request's timeline (no I/O; tested on
hand-built timelines).

Definitions, as `vllm bench serve` and docs/architecture.md give them: TTFT = send -> first token;
E2E = send -> last token; TPOT = (E2E - TTFT) / (output tokens - 1), per request with more
than one token; ITL = every gap between consecutive token-carrying chunks; throughput = output
tokens / the point's duration (first send -> last completion). Percentiles are linear
interpolations (numpy's default); p99 is reported only with at least 1,000 samples, else the
maximum stands in for it (`p99_is_max`). SLO attainment: the share of *all* requests sent that
finished with the full output and met every SLO; errors, refusals (429) and unfinished
requests count as misses. Goodput (DistServe, `sweep.py`): the highest rate whose attainment is
at least 90%.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

MIN_SAMPLES_FOR_P99 = 1000


@dataclass
class RequestResult:
    """One request's timeline, in seconds from its own send time."""

    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0  # tokens asked for
    output_tokens: int = 0  # tokens received
    cached_tokens: int = 0  # prompt tokens the server reports from its prefix cache
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    send_time: float = 0.0  # when it was sent (seconds from the point's start)
    timings: dict = field(default_factory=dict)  # pdserve's legs, when the server sends them

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def complete(self) -> bool:
        """Finished without error and with every token asked for."""
        return self.ok and self.output_tokens >= self.output_len


@dataclass(frozen=True)
class Summary:
    """mean, p50, p90, p99 (the max when fewer than MIN_SAMPLES_FOR_P99 samples), in seconds."""

    mean: float
    p50: float
    p90: float
    p99: float
    count: int

    @property
    def p99_is_max(self) -> bool:
        return self.count < MIN_SAMPLES_FOR_P99

    def as_ms(self) -> dict:
        return {
            "mean_ms": self.mean * 1e3,
            "p50_ms": self.p50 * 1e3,
            "p90_ms": self.p90 * 1e3,
            ("max_ms" if self.p99_is_max else "p99_ms"): self.p99 * 1e3,
            "count": self.count,
        }


def summarize(values: Sequence[float]) -> Summary | None:
    """None for no values."""
    if not values:
        return None
    a = np.asarray(values, dtype=float)
    p99 = float(a.max()) if len(a) < MIN_SAMPLES_FOR_P99 else float(np.percentile(a, 99))
    return Summary(
        float(a.mean()), float(np.percentile(a, 50)), float(np.percentile(a, 90)), p99, len(a)
    )


@dataclass(frozen=True)
class Slo:
    """Per-request SLOs in seconds (`--goodput ttft:500 tpot:50` gives milliseconds). `itl`
    bounds a request's second-largest gap between tokens (one stall is forgiven: the issue's
    stall-sensitive workload W3). `ttft_at`, (prompt tokens, seconds) pairs sorted by length,
    scales the TTFT objective with the prompt, as "2x the peer's unloaded TTFT at the request's
    own length" does: a request's objective is interpolated linearly by its prompt length between
    the pairs (the end pairs hold beyond them); it replaces `ttft` when given."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    itl: float | None = None
    ttft_at: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        lengths = [n for n, _ in self.ttft_at]
        if lengths != sorted(set(lengths)) or any(s <= 0 for _, s in self.ttft_at):
            raise ValueError(
                f"ttft_at: expected increasing lengths and seconds > 0, got {self.ttft_at}"
            )

    def ttft_for(self, prompt_len: int) -> float | None:
        """The TTFT objective (seconds) of a request of `prompt_len` tokens (None: no objective)."""
        if not self.ttft_at:
            return self.ttft
        lengths = [float(n) for n, _ in self.ttft_at]
        return float(np.interp(prompt_len, lengths, [s for _, s in self.ttft_at]))

    @classmethod
    def parse(cls, items: Sequence[str]) -> Slo:
        """["ttft:500", "tpot:50"] (milliseconds). Raises ValueError naming --goodput."""
        values: dict[str, float] = {}
        for item in items:
            name, _, ms = item.partition(":")
            if name not in ("ttft", "tpot", "e2e", "itl") or not ms:
                raise ValueError(
                    f"--goodput: expected ttft:MS, tpot:MS, itl:MS or e2e:MS, got {item!r}"
                )
            try:
                values[name] = float(ms) / 1e3
            except ValueError:
                raise ValueError(f"--goodput: {item!r}: not a number of milliseconds") from None
            if not values[name] > 0:
                raise ValueError(f"--goodput: {item!r}: must be > 0 milliseconds")
        return cls(
            ttft=values.get("ttft"),
            tpot=values.get("tpot"),
            e2e=values.get("e2e"),
            itl=values.get("itl"),
        )

    def met(self, r: RequestResult) -> bool:
        """Whether a complete request met every SLO (a request of one token has no TPOT)."""
        if not r.complete:
            return False
        tpot, ttft = r.tpot, self.ttft_for(r.prompt_len)
        gaps = sorted(r.itl)
        return (
            (ttft is None or r.ttft <= ttft)
            and (self.tpot is None or tpot is None or tpot <= self.tpot)
            and (self.e2e is None or r.e2e <= self.e2e)
            and (self.itl is None or not gaps or gaps[-min(2, len(gaps))] <= self.itl)
        )


@dataclass(frozen=True)
class PointStats:
    """The figures of one point (one rate)."""

    request_rate: float
    num_requests: int
    completed: int
    failed: int
    duration: float
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens per second
    attainment: float | None  # share of all requests meeting every SLO (None: no SLO given)
    ttft: Summary | None
    tpot: Summary | None
    itl: Summary | None
    e2e: Summary | None
    errors: dict[str, int]


def point_stats(results: Sequence[RequestResult], request_rate: float, slo: Slo) -> PointStats:
    """The figures of one point's `results` (every request sent, finished or not)."""
    done = [r for r in results if r.complete]
    if results:
        start = min(r.send_time for r in results)
        end = max(r.send_time + r.e2e for r in results)
        duration = max(end - start, 1e-9)
    else:
        duration = 1e-9
    errors: dict[str, int] = {}
    for r in results:
        if not r.complete:
            key = r.error or "incomplete output"
            errors[key] = errors.get(key, 0) + 1
    has_slo = bool(slo.ttft_at) or any(
        v is not None for v in (slo.ttft, slo.tpot, slo.e2e, slo.itl)
    )
    tpots = [t for r in done if (t := r.tpot) is not None]
    return PointStats(
        request_rate=request_rate,
        num_requests=len(results),
        completed=len(done),
        failed=len(results) - len(done),
        duration=duration,
        request_throughput=len(done) / duration,
        output_throughput=sum(r.output_tokens for r in done) / duration,
        attainment=(sum(slo.met(r) for r in results) / len(results))
        if has_slo and results
        else None,
        ttft=summarize([r.ttft for r in done]),
        tpot=summarize(tpots),
        itl=summarize([gap for r in done for gap in r.itl]),
        e2e=summarize([r.e2e for r in done]),
        errors=errors,
    )
