"""`pdserve bench serve`'s arithmetic on hand-built timelines: TTFT, TPOT, ITL, E2E, percentiles
(p99 only with 1,000 samples), throughput, SLO attainment with errors as misses, goodput and the
sweep's bisection, the arrival schedule, and prompts cut to exact token counts."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import statistics

import numpy as np
import pytest

from services.bench.arrivals import arrival_times
from services.bench.dataset import Lengths, make_requests
from services.bench.stats import RequestResult, Slo, point_stats, summarize
from services.bench.sweep import Point, goodput, run_point, sweep


def _result(
    send: float, ttft: float, gaps: list[float], out: int | None = None, **kw
) -> RequestResult:
    tokens = 1 + len(gaps)
    return RequestResult(
        ok=kw.pop("ok", True),
        prompt_len=10,
        output_len=out if out is not None else tokens,
        output_tokens=tokens,
        ttft=ttft,
        itl=gaps,
        e2e=ttft + sum(gaps),
        send_time=send,
        **kw,
    )


def test_a_point_from_hand_built_timelines():
    slo = Slo.parse(["ttft:500", "tpot:50"])
    results = [
        _result(0.0, 0.100, [0.040, 0.040, 0.040]),  # TPOT 40 ms: meets both
        _result(0.5, 0.600, [0.020, 0.020]),  # TTFT 600 ms: misses
        _result(1.0, 0.200, [0.060, 0.060]),  # TPOT 60 ms: misses
        _result(1.5, 0.300, []),  # one token: no TPOT, TTFT met
        _result(2.0, 0.0, [], ok=False, error="HTTP 429"),  # refused: a miss
        _result(2.5, 0.100, [0.010], out=5),  # stopped short of its output: a miss
    ]
    stats = point_stats(results, 2.0, slo)
    assert (stats.num_requests, stats.completed, stats.failed) == (6, 4, 2)
    assert stats.errors == {"HTTP 429": 1, "incomplete output": 1}
    assert stats.attainment == pytest.approx(2 / 6)
    # duration: first send (0) -> last completion (2.5 + 0.11); tokens of complete requests only
    assert stats.duration == pytest.approx(2.61)
    assert stats.output_throughput == pytest.approx((4 + 3 + 3 + 1) / 2.61)
    assert stats.ttft.p50 == pytest.approx(statistics.median([0.1, 0.6, 0.2, 0.3]))
    assert stats.tpot.mean == pytest.approx((0.04 + 0.02 + 0.06) / 3)
    assert stats.itl.count == 7 and stats.itl.p99 == pytest.approx(0.06) and stats.itl.p99_is_max
    assert stats.e2e.p90 == pytest.approx(float(np.percentile([0.22, 0.64, 0.32, 0.3], 90)))


def test_p99_needs_a_thousand_samples_else_the_max_stands_in():
    few = summarize([float(i) for i in range(999)])
    assert few.p99_is_max and few.p99 == 998 and "max_ms" in few.as_ms()
    many = summarize([float(i) for i in range(1000)])
    assert not many.p99_is_max and many.p99 == pytest.approx(989.01) and "p99_ms" in many.as_ms()
    assert summarize([]) is None


def test_a_ttft_objective_scaled_by_prompt_length():
    # W2's objective: TTFT <= 2x the peer's unloaded TTFT at the request's own length
    slo = Slo(ttft_at=((256, 0.4), (2048, 2.0)), itl=0.1)
    assert slo.ttft_for(256) == 0.4 and slo.ttft_for(2048) == 2.0
    assert slo.ttft_for(1152) == pytest.approx(1.2) and slo.ttft_for(9000) == 2.0
    long = dataclasses.replace(_result(0, 1.5, [0.05, 0.3, 0.05]), prompt_len=2048)
    short = dataclasses.replace(long, prompt_len=256)
    assert slo.met(long) and not slo.met(short)  # 1.5 s meets 2.0 s, not 0.4 s
    assert point_stats([long, short], 1.0, slo).attainment == 0.5
    with pytest.raises(ValueError, match="^ttft_at: "):
        Slo(ttft_at=((2048, 2.0), (256, 0.4)))


@pytest.mark.parametrize("bad", ["ttft", "ttft:", "foo:5", "ttft:abc"])
def test_goodput_flag_is_checked(bad):
    with pytest.raises(ValueError, match="^--goodput: "):
        Slo.parse([bad])


def _point(rate: float, attainment: float) -> Point:
    stats = point_stats([_result(0, 0.1, [0.01])], rate, Slo(ttft=1.0))
    return Point(dataclasses.replace(stats, attainment=attainment), [], 0.0)


def test_goodput_is_the_highest_passing_rate_below_the_first_failure():
    points = [_point(1, 1.0), _point(2, 0.95), _point(4, 0.5), _point(6, 0.92)]  # 6: noise
    found = goodput([p.stats for p in points])
    assert (found.rate, found.resolution) == (2, 2)
    assert goodput([_point(1, 0.5).stats]).rate is None
    assert goodput([_point(1, 0.95).stats]).resolution is None


def test_the_sweep_bisects_the_knee():
    attainment = lambda rate: 1.0 if rate <= 3.3 else 0.0  # noqa: E731 - the server's knee
    asked: list[float] = []

    async def run(rate: float) -> Point:
        asked.append(rate)
        return _point(rate, attainment(rate))

    points = asyncio.run(sweep(run, [4, 1, 2], bisect=3))
    assert asked == [1, 2, 4, 3.0, 3.5, 3.25]
    found = goodput([p.stats for p in points])
    assert (found.rate, found.resolution) == (3.25, 0.25)
    assert [p.stats.request_rate for p in points] == sorted(asked)


def test_a_decided_point_stops_at_the_miss_that_fails_it_and_cancels_the_rest():
    """20 requests, 90% needed: the third miss decides the point (18/20 could still pass). Every
    request after it is cancelled, in flight or unsent, and counts as unfinished; without
    `decide` the same point runs to its end and passes no better."""
    requests = make_requests(str.split, " ".join, 20, Lengths("random", 4, 2), seed=0)
    slo = Slo(ttft=0.5)

    def sender(cancelled: list[int]):
        async def send(request):
            index = requests.index(request)
            try:
                if index >= 8:  # still running when the point is decided
                    await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.append(index)
                raise
            return _result(0, 1.0 if index in (1, 4, 6) else 0.1, [0.01], out=2)

        return send

    cancelled: list[int] = []
    point = asyncio.run(
        run_point(sender(cancelled), requests, 1e6, slo, decide=True, progress=False)
    )
    assert point.stopped_at is not None and point.stopped_at < 30
    assert sorted(cancelled) == list(range(8, 20))
    assert point.stats.attainment == 5 / 20
    assert point.stats.errors == {"not run: the point failed early": 12}
    assert [(r.prompt_len, r.output_len) for r in point.results[8:]] == [(4, 2)] * 12

    early = [r for i, r in enumerate(requests) if i < 8 and i not in (4, 6)]
    kept = asyncio.run(run_point(sender([]), early, 1e6, slo, progress=False))
    assert kept.stopped_at is None and kept.stats.attainment == 5 / 6


def test_arrivals_are_seeded_poisson_with_the_asked_rate():
    times = arrival_times(4000, 4.0, seed=1)
    assert times == arrival_times(4000, 4.0, seed=1) and times[0] == 0.0
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.08)  # exponential: sd = mean
    regular = arrival_times(4000, 4.0, burstiness=16.0, seed=1)
    assert statistics.stdev(b - a for a, b in zip(regular, regular[1:], strict=False)) < 0.1
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="^--request-rate"):
        arrival_times(3, 0.0)


@pytest.mark.parametrize(
    "lengths",
    [
        Lengths("random", 256, 64),
        Lengths("random", 100, 20, range_ratio=0.5),
        Lengths("prefix", 200, 8, prefix_len=150),
        Lengths("chat"),
        Lengths("random", 3, 2),
        Lengths("mix", mix=((0.75, 40, 8), (0.25, 300, 4))),
    ],
)
def test_prompts_have_exact_token_counts_and_are_unique(default_model, lengths):
    from services.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(default_model)
    requests = make_requests(tokenizer.encode, tokenizer.decode, 24, lengths, seed=3)
    again = make_requests(tokenizer.encode, tokenizer.decode, 24, lengths, seed=3)
    for r in requests:
        assert len(tokenizer.encode(r.prompt)) == r.prompt_len
    if lengths.dataset == "random" and not lengths.range_ratio:
        assert {r.prompt_len for r in requests} == {lengths.input_len}
        assert {r.output_len for r in requests} == {lengths.output_len}
    if lengths.dataset == "prefix":
        head = tokenizer.decode(tokenizer.encode(requests[0].prompt)[:140])
        assert all(r.prompt.startswith(head) for r in requests)
    if lengths.dataset == "mix":
        pairs = [(r.prompt_len, r.output_len) for r in requests]
        assert set(pairs) == {(40, 8), (300, 4)} and pairs.count((300, 4)) < 12
    assert [r.prompt_len for r in requests] == [r.prompt_len for r in again]  # seeded lengths
    if lengths.input_len > 8:
        assert len({r.prompt for r in requests + again}) == 48  # fresh tags each run


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--random-input-len", "0"], "--random-input-len"),
        (["--random-output-len", "0"], "--random-output-len"),
        (["--max-concurrency", "0"], "--max-concurrency"),
        (["--random-range-ratio", "2"], "--random-range-ratio"),
        (["--random-prefix-len", "-3"], "--random-prefix-len"),
        (["--num-warmups", "-1"], "--num-warmups"),
        (["--bisect", "-1"], "--bisect"),
        (["--goodput", "ttft:-5"], "--goodput"),
        (["--request-rate", "0"], "--request-rate"),
        (["--dataset-name", "mix"], "--mix"),
        (["--dataset-name", "mix", "--mix", "0.5:256"], "--mix"),
        (["--mix", "1:256:64"], "--mix"),
        (["--slo-headers"], "--slo-headers"),  # no objective to send
    ],
)
def test_bad_bench_flags_are_refused_by_name_before_any_request(capsys, flags, named):
    from services.cli import main as cli

    argv = ["bench", "serve", "--base-url", "http://127.0.0.1:1", "--num-prompts", "2", *flags]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.startswith(f"pdserve: error: {named}: ")


def test_objectives_travel_as_llm_d_headers():
    from services.bench.backends import objective_headers

    headers = objective_headers(Slo.parse(["ttft:500", "tpot:37.5", "itl:120"]), 256)
    assert headers == {"x-slo-ttft-ms": "500", "x-slo-tpot-ms": "37.5", "x-slo-itl-ms": "120"}
    scaled = Slo(tpot=0.05, ttft_at=((256, 0.4), (2048, 2.0)))  # the suite's W2: by length
    assert objective_headers(scaled, 2048) == {"x-slo-ttft-ms": "2000", "x-slo-tpot-ms": "50"}
    assert objective_headers(Slo(), 256) == objective_headers(None, 256) == {}


def test_the_itl_objective_forgives_one_stall():
    """`--goodput itl:MS` bounds each request's second-largest gap between tokens."""
    slo = Slo.parse(["itl:100"])
    assert slo.itl == 0.1
    one_stall = _result(0, 0.1, [0.02, 0.5, 0.03, 0.04])
    two_stalls = _result(0, 0.1, [0.02, 0.5, 0.2, 0.04])
    assert slo.met(one_stall) and not slo.met(two_stalls)
    with pytest.raises(ValueError, match="itl:MS"):
        Slo.parse(["gap:100"])
    stats = point_stats([one_stall, two_stalls], 1.0, slo)  # alone, it still sets goodput
    assert stats.attainment == 0.5
