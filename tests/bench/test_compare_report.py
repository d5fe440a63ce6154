"""compare_report's verdicts on hand-built results: ratios per repeat, the worst repeat decides."""

from benchmarks.compare_report import goodput_table, legs_table, sweep_table, targets
from benchmarks.compare_serving import _next_rate, repeat_plan


def _point(rate, attainment, ttft, tpot, requests=None):
    p = {
        "request_rate": rate,
        "attainment": attainment,
        "achieved_rps": rate,
        "ttft_p50_ms": ttft,
        "ttft_p99_ms": ttft * 2,
        "tpot_p50_ms": tpot,
        "tpot_p99_ms": tpot * 2,
        "failed": 0,
        "problems": {"cached": 0, "short": 0},
    }
    if requests is not None:
        p["requests"] = requests
    return p


def _phase(itl, tpot):
    return {"itl_p99_ms": itl, "tpot_p50_ms": tpot}


def _data(pd_goodput, vllm_goodput, pd_ttfts):
    timed = [
        {"ttft": 0.2, "timings": {leg: 0.01 for leg in ("router_queue", "tokenize")}
         | {"prefill_queue": 0.0, "prefill": 0.15, "kv_transfer": 0.01, "decode_queue": 0.02,
            "first_decode_step": 0.01}},
    ]  # fmt: skip
    runs = [
        {
            "vllm": [_point(1.0, 1.0, 100.0, 30.0)],
            "pdserve": [_point(1.0, 0.95, ttft, 27.0, timed if i == 0 else None)],
        }
        for i, ttft in enumerate(pd_ttfts)
    ]
    return {
        "runs": runs,
        "goodput": {"vllm": vllm_goodput, "pdserve": pd_goodput},
        "goodput_resolution": {"vllm": 0.5, "pdserve": None},
        "interference": {
            "vllm": {
                "alone": _phase(40.0, 25.0),
                "with_long_prompts": _phase(1000.0, 50.0),
                "long_prompts": 22,
                "long_failed": 0,
                "long_ttft_p50_ms": 1000.0,
            },
            "pdserve": {
                "alone": _phase(40.0, 25.0),
                "with_long_prompts": _phase(60.0, 30.0),
                "long_prompts": 22,
                "long_failed": 0,
                "long_ttft_p50_ms": 1400.0,
            },
        },
    }


def test_the_worst_repeat_decides_each_ratio():
    # TTFT ratios 0.9, 1.1, 0.95: the median meets 1.0x, the worst does not
    data = _data([None] * 3, [1.0] * 3, [90.0, 110.0, 95.0])
    lines = targets(data).splitlines()
    assert "**met** (1.50x alone, 0.060x vLLM's)" in lines[1]
    assert "**missed** (worst 1.100x; median 0.95x, range 0.90-1.10x)" in lines[2]
    assert "**met** (worst 0.900x; median 0.90x, range 0.90-0.90x)" in lines[3]  # 27 / 30 ms
    assert "**met** (1.40x)" in lines[4]


def test_a_repeat_that_did_not_measure_a_figure_misses_it():
    data = _data([None] * 2, [1.0] * 2, [90.0, 90.0])
    data["runs"][1]["pdserve"][0]["ttft_p50_ms"] = None  # nothing completed there
    assert "TTFT p50 at 1 req/s ≤ 1.0x vLLM's: **missed**: measured in 1 of 2" in targets(data)
    data["interference"]["pdserve"]["long_failed"] = 3
    assert "**missed**: 3 of 22 long prompts failed" in targets(data)


def _goodput_of(data, name, repeat, passing, failing):
    data["runs"][repeat][name] = [_point(r, 0.95, 100.0, 30.0) for r in passing] + [
        _point(r, 0.5, 100.0, 30.0) for r in failing
    ]


def test_goodput_comes_from_each_repeats_own_points_and_bounds_decide():
    data = _data([None] * 3, [None] * 3, [90.0] * 3)
    _goodput_of(data, "vllm", 0, [0.5], [0.75])  # 0.5, exact
    _goodput_of(data, "pdserve", 0, [], [0.5])  # < 0.5: ratio < 1.0 -> missed
    _goodput_of(data, "vllm", 1, [0.75], [1.0])
    _goodput_of(data, "pdserve", 1, [], [1.0])  # < 1.0 against 0.75: < 1.33, undecided
    _goodput_of(data, "vllm", 2, [], [1.0])
    _goodput_of(data, "pdserve", 2, [2.0], [])  # >= 2 against < 1: > 2x, met
    table = goodput_table(data).splitlines()
    assert table[2] == "| vLLM | 0.5 (0.75 failed) | 0.75 (1 failed) | < 1 |"
    assert table[3] == "| pdserve | < 0.5 | < 1 | ≥ 2 |"
    line = targets(data).splitlines()[0]
    assert line == (
        "- Goodput ≥ 1.3x vLLM's: **missed** (repeat 0: missed, repeat 1: undecided, "
        "repeat 2: met)."
    )
    _goodput_of(data, "pdserve", 0, [1.0], [])  # >= 1 against 0.5 exact: 2x, met
    assert "**not decided**" in targets(data)  # repeat 1 still undecided
    _goodput_of(data, "pdserve", 1, [1.0], [1.5])  # 1 / 0.75 = 1.33 exact: met
    assert "**met** (repeat 0: met, repeat 1: met, repeat 2: met)" in targets(data)


def test_tables_carry_every_point_and_the_legs():
    data = _data([1.0], [1.0], [90.0])
    assert sweep_table(data).count("\n") == 3  # header, rule, two points
    legs = legs_table(data).splitlines()[-1]
    assert legs == "| pdserve | 200.0 | 10.0 | 10.0 | 0.0 | 150.0 | 10.0 | 20.0 | 10.0 |"
    data["runs"][0]["pdserve"][0].pop("requests")
    assert "no point at 1 req/s kept" in legs_table(data)


def test_later_repeats_rerun_1_rps_and_both_sides_of_the_knee():
    points = [_point(r, a, 100.0, 30.0) for r, a in ((0.5, 0.97), (1.0, 0.89), (0.75, 0.96))]
    assert repeat_plan(points) == [0.75, 1.0]
    assert _next_rate(points, floor=0.125) == 0.875  # halfway across 0.75 -> 1
    failing = [_point(r, a, 100.0, 30.0) for r, a in ((0.5, 0.6), (1.0, 0.3))]
    assert repeat_plan(failing) == [1.0]
    assert _next_rate(failing, floor=0.125) == 0.25  # 60% at the lowest: halve it
    assert _next_rate(failing, floor=0.3) is None  # not below the floor
    failing[0]["attainment"] = 0.2
    assert _next_rate(failing, floor=0.125) is None  # far from 90%: not chased down
    passing = [_point(r, 0.95, 100.0, 30.0) for r in (1.0, 2.0)]
    assert repeat_plan(passing) == [1.0, 2.0] and _next_rate(passing, floor=0.125) is None
