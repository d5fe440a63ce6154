"""compare_report's verdicts on hand-built results: ratios per repeat, the worst repeat decides."""

from benchmarks.compare_report import goodput_table, legs_table, sweep_table, targets


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
    data = _data([2.0, 2.0, 1.0], [1.0, 1.0, 1.0], [90.0, 110.0, 95.0])
    lines = targets(data).splitlines()
    assert lines[0].startswith("- Goodput") and "**missed**" in lines[0]  # 1.0x in repeat 3
    assert "range 1.00-2.00x" in lines[0]
    assert "**met** (1.50x alone, 0.060x vLLM's)" in lines[1]
    assert "**missed** (median 0.95x, range 0.90-1.10x)" in lines[2]
    assert "**met** (median 0.90x, range 0.90-0.90x)" in lines[3]  # TPOT 27 / 30
    assert "**met** (1.40x)" in lines[4]


def test_goodput_below_the_lowest_rate_is_not_a_ratio():
    data = _data([None, None, None], [1.0, 0.5, 1.0], [90.0, 90.0, 90.0])
    assert "**missed**: in at least one repeat no rate run met 90%" in targets(data)
    assert "| pdserve | < 1, < 1, < 1 | - |" in goodput_table(data)
    neither = _data([None], [None], [90.0])
    assert "**not decided**" in targets(neither)


def test_tables_carry_every_point_and_the_legs():
    data = _data([1.0], [1.0], [90.0])
    assert sweep_table(data).count("\n") == 3  # header, rule, two points
    legs = legs_table(data).splitlines()[-1]
    assert legs == "| pdserve | 200.0 | 10.0 | 10.0 | 0.0 | 150.0 | 10.0 | 20.0 | 10.0 |"
