"""The serving suite's workloads and rate search (benchmarks/workloads.py) on hand-set figures
and fake servers: objectives scaled from the peer's T0 and P0, the predicted knee from a step-cost
model, and a search that settles each goodput within its resolution, or below the floor."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.workloads import (
    FLOOR_RATE,
    RESOLUTION,
    SUITE,
    knee_utilisation,
    next_rate,
    point_requests,
    predicted_knee,
)
from services.bench.sweep import Goodput, goodput
from services.cost_model.step_cost import StepCost


def _point(rate: float, attainment: float) -> SimpleNamespace:
    return SimpleNamespace(request_rate=rate, attainment=attainment)


def test_objectives_scale_with_the_peers_unloaded_figures():
    t0, p0 = {256: 0.3, 2048: 2.5}, 0.04
    w1 = SUITE["W1"].objectives(t0, p0)
    assert w1.ttft_for(256) == pytest.approx(0.6) and w1.tpot == pytest.approx(0.06)
    assert w1.itl is None
    w3 = SUITE["W3"].objectives(t0, p0)
    assert SUITE["W3"].prompt_lengths() == (256, 2048)
    assert w3.ttft_for(2048) == pytest.approx(5.0) and w3.itl == pytest.approx(0.12)
    assert not SUITE["U"].tuned and SUITE["U"].prompt_lengths() == (512,)
    with pytest.raises(KeyError, match="2048"):
        SUITE["W4"].objectives({256: 0.3}, p0)


def test_points_hold_150_requests_or_3_minutes():
    assert point_requests(0.2) == 150 and point_requests(2.0) == 360


def test_the_knee_is_predicted_from_the_step_costs_and_the_ttft_headroom():
    # 1 ms per prefill token and 10 ms per decode step of 8 rows: a 256/64 request costs
    # 0.256 + 64 * 0.010 / 8 = 0.336 s of engine time
    cost = StepCost(2, (0.0, 1e-3, 0.0, 0.0, 0.010 / 8, 0.0, 0.0))
    slo = SUITE["W1"].objectives({256: 0.256}, 0.03)  # TTFT <= 512 ms: 256 ms of headroom
    rho = 0.256 / (0.256 + 2.3 * 0.256 / 2)
    assert predicted_knee(SUITE["W1"], cost, slo, {256: 0.256}) == pytest.approx(rho / 0.336)
    # a row whose unloaded TTFT is 0.48 s (one thread) has 32 ms of headroom: it starts low
    slow = predicted_knee(SUITE["W1"], cost, slo, {256: 0.48})
    assert slow == pytest.approx(0.032 / (0.032 + 2.3 * 0.48 / 2) / (0.48 + 0.08))
    assert knee_utilisation(0.4, 0.5) == 0.05 and knee_utilisation(100.0, 0.1) == 0.9
    # without fitted costs: the unloaded TTFT, and an 8-row decode step at the unloaded TPOT
    unfitted = predicted_knee(SUITE["W1"], None, slo, {256: 0.256}, unloaded_tpot_s=0.010)
    assert unfitted == pytest.approx(rho / 0.336)
    slo2 = SUITE["W2"].objectives({256: 0.256, 2048: 2.048}, 0.03)
    mixed = 0.85 * 0.336 + 0.15 * (2.048 + 0.08)
    assert predicted_knee(SUITE["W2"], cost, slo2, {256: 0.256, 2048: 2.048}) == pytest.approx(
        rho / mixed
    )


@pytest.mark.parametrize(("capacity", "start"), [(1.37, 0.5), (0.42, 3.0), (2.0, 2.1)])
def test_the_search_settles_the_knee_within_its_resolution(capacity, start):
    def attainment(rate: float) -> float:  # a server that passes up to its capacity
        return 0.97 if rate <= capacity else (0.8 if rate < capacity * 1.3 else 0.2)

    points: list[SimpleNamespace] = []
    while (rate := next_rate(points, start)) is not None:
        points.append(_point(rate, attainment(rate)))
        assert len(points) < 20
    found = goodput(points)
    failing = found.rate + found.resolution
    assert found.rate <= capacity < failing and failing / found.rate <= RESOLUTION + 1e-9


def test_a_server_failing_at_the_floor_has_goodput_below_it():
    points: list[SimpleNamespace] = []
    while (rate := next_rate(points, 0.3)) is not None:
        points.append(_point(rate, 0.1))
    assert min(p.request_rate for p in points) == FLOOR_RATE
    assert goodput(points) == Goodput(None, None)


def _run(**rows: list[tuple[float, float]]) -> dict[str, list[dict]]:
    return {
        row: [{"request_rate": r, "attainment": a} for r, a in pts] for row, pts in rows.items()
    }


def test_paired_repeats_rerun_the_knee_and_the_targets_need_the_worst_repeat_too():
    from benchmarks.suite import knee_rates
    from benchmarks.suite_report import ratios, verdict

    assert knee_rates(
        [{"request_rate": 1.0, "attainment": 0.95}, {"request_rate": 1.1, "attainment": 0.5}]
    ) == [1.0, 1.1]
    assert knee_rates([{"request_rate": 0.1, "attainment": 0.3}]) == [0.1]
    data = {
        "runs": [
            _run(vllm=[(1.0, 0.95), (1.1, 0.5)], pdserve=[(1.2, 0.95), (1.3, 0.6)]),
            _run(vllm=[(1.0, 0.95), (1.1, 0.5)], pdserve=[(1.2, 0.5), (1.3, 0.2)]),
        ]
    }
    assert ratios(data, "pdserve", ["vllm"]) == [pytest.approx(1.2), None]
    assert verdict(ratios(data, "pdserve", ["vllm"]), 1.0).startswith("not decided")
    assert verdict([1.2, 0.95, 1.1], 1.0).startswith("met")
    assert verdict([1.2, 0.85, 1.1], 1.0).startswith("missed")  # the worst below 0.9x
    assert verdict([0.98, 0.97, 1.1], 1.0).startswith("missed")  # the median below


def test_a_w2_sitting_rescored_as_w3_applies_the_gap_objective_to_the_same_requests():
    from benchmarks.suite_report import rescored

    def request(stalls: int) -> dict:  # 20 tokens: 19 gaps of 20 ms, `stalls` of them 200 ms
        gaps = [0.2] * stalls + [0.02] * (19 - stalls)
        return {"ok": True, "prompt_len": 256, "output_len": 20, "output_tokens": 20,
                "ttft": 0.1, "e2e": 0.1 + sum(gaps), "itl": gaps}  # fmt: skip

    point = {"request_rate": 1.0, "attainment": 1.0, "requests": [request(n) for n in (0, 1, 2)]}
    data = {"config": {"workload": "W2"}, "t0_s": {"256": 0.2, "2048": 2.0}, "p0_s": 0.03,
            "runs": [{"pdserve": [point]}]}  # fmt: skip
    # P0 30 ms: mean TPOT <= 45 ms holds for all three (at most 39 ms); W3's second-largest gap
    # <= 90 ms forgives one stall, not two
    assert rescored(data, "W2")["runs"][0]["pdserve"][0]["attainment"] == pytest.approx(1.0)
    w3 = rescored(data, "W3")
    assert w3["config"]["workload"] == "W3" and w3["config"]["rescored_from"] == "W2"
    assert w3["runs"][0]["pdserve"][0]["attainment"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="W1"):
        rescored(data, "W1")
