"""The per-step token budget: a step that mixes prompt tokens into running decodes takes the
largest chunk whose predicted time fits the tightest ITL objective (a hand-made cost model)."""

from __future__ import annotations

import math
import random

import pytest

from services.cost_model.step_cost import StepCost
from services.engine import SamplingParams
from services.engine.errors import InvalidRequestError
from services.engine.objectives import StreamObjectives
from services.engine.step_budget import (
    ITL_DECODE_STEPS,
    LIVE_SCALE_BOUNDS,
    LIVE_SCALE_WEIGHT,
    TPOT_HORIZON_TOKENS,
    LiveScale,
    StepBudget,
    allowed_step_s,
    default_itl_s,
    stream_itl_s,
    worth_packing,
)
from tests.engine.helpers import GREEDY, make_engine, run_to_completion
from tests.reference import assert_equivalent, hf_greedy

# 10 ms a step, 1 ms a prompt token, 1 ms a decode row; attention and context free.
FAKE = StepCost(1, (0.010, 0.001, 0.0, 0.0, 0.001, 0.0, 0.0))


@pytest.mark.parametrize(
    ("decodes", "itl_s", "cap", "expected"),
    [
        ((100, 200, 300, 400), 0.050, 1000, 36),  # 10 + 4 + n <= 50
        ((100,), 0.050, 20, 20),  # the cap binds
        ((), math.inf, 500, 500),  # no bound: the cap
        ((), 0.050, 500, 40),  # a bound without decode rows (borrowed CPUs): 10 + n <= 50
        ((100,) * 45, 0.050, 1000, 16),  # nothing fits: a prompt still advances 16 tokens
        ((100,) * 4, 0.050, 8, 8),  # ... but never beyond the cap
    ],
)
def test_the_largest_chunk_that_fits(decodes, itl_s, cap, expected):
    assert StepBudget(FAKE).prefill_tokens(decodes, 0, itl_s, cap) == expected


def test_attention_over_cached_context_shrinks_the_chunk():
    cost = StepCost(1, (0.010, 0.001, 1e-5, 0.0, 0.001, 0.0, 0.0))
    fresh = StepBudget(cost).prefill_tokens((50,), 0, 0.050, 1000)
    after_cache = StepBudget(cost).prefill_tokens((50,), 2000, 0.050, 1000)
    assert 16 <= after_cache < fresh < 39  # 10 + 1 + n + 1e-2 * n * (cached + n) <= 50


def _use(engine, cost: StepCost) -> None:
    """Size mixed steps by a hand-made `cost`, taken as exact: the tiny model's steps take
    microseconds, which the live ratio would otherwise learn (test_the_live_ratio_...)."""
    engine.use_step_cost(cost)
    engine.scheduler.live_scale = LiveScale(weight=0.0)


def _prompts(lens, seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(2, 512) for _ in range(n)] for n in lens]


def test_mixed_steps_follow_the_tightest_objective_and_greedy_output_is_unchanged(tiny_model):
    """A stream with the engine's 40 ms objective decodes; a second stream asks for 31 ms; then
    a 120-token prompt arrives. Each mixed step's chunk is what the fake model lets fit the
    tightest running objective, a step with no decode row is uncapped, and every output
    equals the reference."""
    engine = make_engine(tiny_model, num_blocks=256, slo_itl_ms=40.0)
    _use(engine, FAKE)
    first, second, late = _prompts([20, 24, 120])
    engine.add_request(first, SamplingParams(max_tokens=30, **GREEDY), request_id="first")
    engine.step()
    assert engine.last_forward_tokens == {"first": 20}  # no decode row: uncapped
    assert engine.scheduler.last_prefill_budget is None
    engine.add_request(
        second, SamplingParams(max_tokens=30, **GREEDY), request_id="second",
        objectives=StreamObjectives(itl_s=0.031),
    )  # fmt: skip
    engine.step()  # "first" decodes: 10 + 1 + n <= 40 leaves 29, and all 24 fit
    assert engine.last_forward_tokens == {"first": 1, "second": 24}
    assert engine.scheduler.last_prefill_budget == 29
    late_params = SamplingParams(max_tokens=8, **GREEDY)
    outs, steps = run_to_completion(engine, {"late": (late, late_params)})
    # both decode, "second" the tightest: 10 + 2 + n <= 31 leaves 19 prompt tokens a step
    late_chunks = [s["late"] for s in steps if s.get("late", 0) > 1]
    assert late_chunks == [19] * 6 + [6]
    assert all(s.get("first") == 1 and s.get("second") == 1 for s in steps[:7])
    for rid, prompt, n in (("first", first, 30), ("second", second, 30), ("late", late, 8)):
        assert_equivalent(outs[rid], hf_greedy(tiny_model, prompt, n), rid)


def test_without_an_itl_objective_a_stream_allows_five_of_its_decode_steps(tiny_model):
    """No --slo-itl-ms and none from the stream: a mixed step may take 5x the predicted
    decode-only step of its rows (Sarathi-Serve's strict objective), so the chunk follows the
    machine's own decode speed; greedy output is unchanged."""
    assert ITL_DECODE_STEPS == 5.0 and default_itl_s(0.012) == pytest.approx(0.060)
    engine = make_engine(tiny_model, num_blocks=256)
    assert engine.config.slo_itl_ms is None
    _use(engine, StepCost(1, (0.010, 0.001, 0.0, 0.0, 0.001, 0.0005, 0.0)))
    first, late = _prompts([20, 100])
    engine.add_request(first, SamplingParams(max_tokens=30, **GREEDY), request_id="first")
    engine.step()
    late_params = SamplingParams(max_tokens=4, **GREEDY)
    outs, steps = run_to_completion(engine, {"late": (late, late_params)})
    # one decode row: 11 ms decode-only, so a chunk's step 10 + 1 + 0.5 + n <= 55 ms takes 43
    # tokens (the TPOT objective's 100 ms default is wider and does not bind)
    assert [s["late"] for s in steps if s.get("late", 0) > 1] == [43, 43, 14]
    for rid, prompt, n in (("first", first, 30), ("late", late, 4)):
        assert_equivalent(outs[rid], hf_greedy(tiny_model, prompt, n), rid)


def test_a_stream_stating_tpot_but_no_itl_is_bounded_by_its_tpot_slack_alone(tiny_model):
    """llm-d's headers state TTFT and TPOT objectives, no ITL one: such a stream has no ITL
    objective (not the five-decode-step default), so a prompt beside it takes what its TPOT
    slack allows, here all 100 tokens in one step. Its own ITL objective, or the engine's
    --slo-itl-ms, still binds. Greedy output is unchanged."""
    step = 0.0115
    assert stream_itl_s(StreamObjectives(tpot_s=0.1), None, step) == math.inf
    assert stream_itl_s(StreamObjectives(), None, step) == default_itl_s(step)
    assert stream_itl_s(StreamObjectives(itl_s=0.02, tpot_s=0.1), None, step) == 0.02
    assert stream_itl_s(StreamObjectives(tpot_s=0.1), 0.04, step) == 0.04
    assert allowed_step_s(math.inf, 0.1, None, 0, now=5.0) == 0.1  # no first token yet
    engine = make_engine(tiny_model, num_blocks=256)
    _use(engine, StepCost(1, (0.010, 0.001, 0.0, 0.0, 0.001, 0.0005, 0.0)))
    first, late = _prompts([20, 100])
    engine.add_request(
        first, SamplingParams(max_tokens=30, **GREEDY), request_id="first",
        objectives=StreamObjectives(tpot_s=0.1),
    )  # fmt: skip
    engine.step()
    late_params = SamplingParams(max_tokens=4, **GREEDY)
    outs, steps = run_to_completion(engine, {"late": (late, late_params)})
    assert [s["late"] for s in steps if s.get("late", 0) > 1] == [100]  # 43 without objectives
    for rid, prompt, n in (("first", first, 30), ("late", late, 4)):
        assert_equivalent(outs[rid], hf_greedy(tiny_model, prompt, n), rid)


def test_the_shortest_step_that_still_meets_a_prompts_deadline():
    """FAKE: a step of n prompt tokens beside one row is 10 + n + 1 ms; 100 tokens in k equal
    chunks take k * (11 + ceil(100 / k)) ms: 111, 122, 135, 144, ... ms (at most 7 steps of 16
    tokens or more). The most steps within
    the time left sets the chunk; none in time (even one step) gives 0.0 (the deadline is
    lost), and the cap sets the fewest steps there can be."""
    budget = StepBudget(FAKE)
    assert budget.deadline_step_s((100,), 100, 0, 0.140, 1000) == pytest.approx(0.011 + 0.034)
    assert budget.deadline_step_s((100,), 100, 0, 0.115, 1000) == pytest.approx(0.111)
    assert budget.deadline_step_s((100,), 100, 0, 0.100, 1000) == 0.0
    assert budget.deadline_step_s((100,), 100, 0, 1.000, 1000) == pytest.approx(0.026)  # 7 x 15
    assert budget.deadline_step_s((100,), 100, 0, 0.115, 50) == 0.0  # two steps: 122 ms
    assert budget.deadline_step_s((100,), 0, 0, 0.115, 1000) == 0.0  # nothing left to run


def test_a_prompts_ttft_objective_widens_the_chunks_beside_streams(tiny_model):
    """A 100-token prompt beside a stream without objectives: the ITL default (5 decode steps
    of 51 ms) cuts it into 51 + 49. Given a TTFT objective that two steps would miss (one is
    451 ms, two 502 ms), it runs whole; one already lost (300 ms) changes nothing; a stream's
    own ITL objective (300 ms) still caps the step. Greedy output is unchanged."""
    cost = StepCost(1, (0.050, 0.004, 0.0, 0.0, 0.001, 0.0, 0.0))

    def chunks(ttft_s, itl_s=None):
        engine = make_engine(tiny_model, num_blocks=256)
        _use(engine, cost)
        first, late = _prompts([20, 100])
        engine.add_request(
            first, SamplingParams(max_tokens=12, **GREEDY), request_id="first",
            objectives=StreamObjectives(itl_s=itl_s),
        )  # fmt: skip
        engine.step()
        params = SamplingParams(max_tokens=3, **GREEDY)
        engine.add_request(
            late, params, request_id="late", objectives=StreamObjectives(ttft_s=ttft_s)
        )
        outs, steps = run_to_completion(engine, {})
        assert_equivalent(outs["late"], hf_greedy(tiny_model, late, 3), f"late {ttft_s}")
        return [s["late"] for s in steps if s.get("late", 0) > 1]

    assert chunks(None) == [51, 49]
    assert chunks(0.48) == [100]
    assert chunks(0.30) == [51, 49]
    assert chunks(0.48, itl_s=0.3) == [62, 38]


def test_the_live_ratio_learns_how_much_longer_mixed_steps_run_than_predicted():
    scale = LiveScale()
    assert scale.ratio(2) == 1.0
    for _ in range(60):
        scale.observe(2, predicted_s=0.100, observed_s=0.130)
    assert scale.ratio(2) == pytest.approx(1.3, rel=0.01) and scale.ratio(1) == 1.0
    before = scale.ratio(2)
    scale.observe(2, 0.1, 100.0)  # one wild step: clamped, then weighted
    wild = before + LIVE_SCALE_WEIGHT * (LIVE_SCALE_BOUNDS[1] - before)
    assert scale.ratio(2) == pytest.approx(wild)
    scale.observe(2, 0.0, 1.0)  # no prediction: ignored
    assert scale.ratio(2) == pytest.approx(wild)


def test_mixed_steps_slower_than_predicted_shrink_the_next_chunks(tiny_model):
    """The engine folds each mixed step's seconds into its live ratio; a ratio of 2 halves the
    time a chunk may be predicted to take (FAKE: 10 + 1 + n <= 50 / 2 leaves 14, the 16-token
    floor). Greedy output is unchanged."""
    engine = make_engine(tiny_model, num_blocks=256, slo_itl_ms=50.0)
    engine.use_step_cost(FAKE)
    assert engine.scheduler.live_scale.weight == LIVE_SCALE_WEIGHT
    first, late = _prompts([20, 100])
    engine.add_request(first, SamplingParams(max_tokens=30, **GREEDY), request_id="first")
    engine.step()
    engine.add_request(late, SamplingParams(max_tokens=4, **GREEDY), request_id="late")
    engine.step()
    assert engine.last_forward_tokens == {"first": 1, "late": 39}  # 10 + 1 + n <= 50
    # the tiny model's real step took far less than FAKE's 50 ms: the ratio fell
    assert engine.scheduler.live_scale.ratio(1) < 1.0
    engine.scheduler.live_scale.ratios[1] = 2.0  # as if served steps ran twice as long
    engine.step()
    assert engine.last_forward_tokens == {"first": 1, "late": 16}
    outs, _ = run_to_completion(engine, {})
    assert_equivalent(outs["late"], hf_greedy(tiny_model, late, 4), "late")


@pytest.mark.parametrize(
    ("first_token_at", "num_output_tokens", "expected"),
    [
        (None, 0, 0.250),  # no token yet: the ITL objective
        (0.0, 10, 0.250),  # 10 tokens in 0 s: 0.5 s of slack, capped at the ITL objective
        (-0.4, 10, 0.100),  # 10 tokens in 0.4 s: 0.1 s of slack left
        (-5.0, 10, 0.050),  # behind: one TPOT objective a step, to catch up
    ],
)
def test_a_streams_allowance_is_its_itl_objective_shortened_to_its_tpot_slack(
    first_token_at, num_output_tokens, expected
):
    allowed = allowed_step_s(0.250, 0.050, first_token_at, num_output_tokens, now=0.0)
    assert allowed == pytest.approx(expected)


@pytest.mark.parametrize(
    ("remaining", "decode_step_s", "expected"),
    [
        (0, 0.030, 0.050),  # its last token: nothing to come, on time: one objective
        (4, 0.030, 0.080),  # 4 tokens to come at 30 ms save 4 x 20 ms against 50 ms
        (40, 0.040, 0.160),  # only TPOT_HORIZON_TOKENS of them count: 16 x 10 ms
        (40, 0.030, 0.250),  # ... and the ITL objective caps it
        (40, 0.060, 0.050),  # decode steps slower than the objective save nothing
    ],
)
def test_the_coming_tokens_lend_their_projected_tpot_slack(remaining, decode_step_s, expected):
    """A stream exactly on its mean TPOT (10 tokens in 0.5 s at 50 ms) may take a longer step
    now when its next tokens are projected to come faster than the objective."""
    assert TPOT_HORIZON_TOKENS == 16
    allowed = allowed_step_s(0.250, 0.050, -0.5, 10, 0.0, remaining, decode_step_s)
    assert allowed == pytest.approx(expected)


def test_a_stream_that_ran_long_is_taken_to_run_as_long_again():
    """30 tokens made on time: 30 of its 100 coming ones count (30 x 5 ms), not 16."""
    allowed = allowed_step_s(0.250, 0.050, -1.5, 30, 0.0, 100, 0.045)
    assert allowed == pytest.approx(30 * 0.005)


def test_a_stream_behind_its_tpot_objective_shrinks_the_chunk(tiny_model):
    """With a 35 ms TPOT objective, a stream that is behind allows 35 ms steps (10 + 1 + n <=
    35: 24-token chunks) though its ITL objective is 250 ms; once ahead again, 250 ms. A
    stream's own objective replaces the engine's."""
    engine = make_engine(tiny_model, num_blocks=256, slo_itl_ms=250.0, slo_tpot_ms=35.0)
    _use(engine, FAKE)
    first, late = _prompts([20, 300])
    engine.add_request(first, SamplingParams(max_tokens=30, **GREEDY), request_id="first")
    engine.step()
    (stream,) = engine.scheduler.running
    stream.first_token_time -= 10.0  # ten seconds for one token: far behind
    engine.add_request(late, SamplingParams(max_tokens=4, **GREEDY), request_id="late")
    engine.step()
    assert engine.last_forward_tokens == {"first": 1, "late": 24}
    stream.first_token_time += 20.0  # far ahead: the ITL objective binds (10 + 1 + n <= 250)
    engine.step()
    assert engine.last_forward_tokens == {"first": 1, "late": 239}
    stream.first_token_time -= 20.0  # behind again, and now its own objective is 20 ms
    stream.objectives = StreamObjectives(tpot_s=0.020)  # (set as add_request would)
    engine.step()
    assert engine.last_forward_tokens == {"first": 1, "late": 16}  # 9 fit: the 16-token floor
    engine.check_integrity()


def test_an_objective_must_be_positive(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=16)
    for bad in (dict(itl_s=0), dict(tpot_s=-1.0), dict(tpot_s=float("nan")), dict(itl_s=True)):
        with pytest.raises(InvalidRequestError, match=next(iter(bad))):
            engine.add_request(
                [3, 4], SamplingParams(max_tokens=2), objectives=StreamObjectives(**bad)
            )
    with pytest.raises(ValueError, match=r"^slo_itl_ms: must be > 0 milliseconds"):
        make_engine(tiny_llama, num_blocks=16, slo_itl_ms=-1)
    with pytest.raises(ValueError, match=r"^slo_tpot_ms: must be > 0 milliseconds"):
        make_engine(tiny_llama, num_blocks=16, slo_tpot_ms=0)


@pytest.mark.parametrize(
    ("step_rows", "chunk", "behind", "expected"),
    [
        ((), (40, 0), 5, True),  # the step's first prompt always joins
        (((1, 99), (1, 50)), (40, 0), 0, True),  # beside decode rows only: the budget decides
        (((40, 0),), (40, 0), 0, False),  # 1 x 40 ms delay against a 10 ms step saved
        (((40, 0),), (40, 0), 2, False),  # 40 > (1 + 2) x 10
        (((40, 0),), (40, 0), 4, True),  # 40 < (1 + 4) x 10: a long queue packs
        (((4, 0),), (4, 0), 0, True),  # tiny prompts share a step: 4 < 10
        (((4, 0), (4, 0), (4, 0)), (4, 0), 0, False),  # ... until 3 x 4 > 10
    ],
)
def test_a_prompt_joins_a_step_only_where_that_lowers_the_queues_total_ttft(
    step_rows, chunk, behind, expected
):
    """k prompt rows each wait the chunk's marginal seconds d (1 ms a token); packing saves the
    chunk and each prompt behind it a step's fixed 10 ms: join iff k * d < (1 + behind) * 10."""
    assert worth_packing(StepBudget(FAKE), step_rows, chunk, behind) is expected


def test_a_chunk_leaving_part_of_its_prompt_joins_only_a_step_without_prompts():
    """A partial chunk saves nobody a step: it rides only where no prompt row would wait."""
    budget = StepBudget(FAKE)
    assert worth_packing(budget, ((1, 99),), (3, 0), 0, completes=False)
    assert not worth_packing(budget, ((40, 0),), (3, 0), 9, completes=False)
    assert worth_packing(budget, ((40, 0),), (3, 0), 0, completes=True)  # 3 < 10


@pytest.mark.parametrize(("length", "packed"), [(40, False), (4, True)])
def test_queued_prompts_get_steps_of_their_own_unless_tiny(tiny_model, length, packed):
    """Three prompts queued at once on an idle engine with a cost model: 40-token prompts
    (40 ms of compute against a 10 ms step) each take their own step, so the first one's TTFT is
    its own prefill, not the three's; 4-token ones share the first step. Without a cost model
    `max_num_batched_tokens` alone packs them, as before. Greedy output is unchanged."""
    engine = make_engine(tiny_model, num_blocks=256)
    _use(engine, FAKE)
    prompts = _prompts([length] * 3, seed=5)
    params = SamplingParams(max_tokens=4, **GREEDY)
    outs, steps = run_to_completion(engine, {f"p{i}": (p, params) for i, p in enumerate(prompts)})
    if packed:
        assert steps[0] == {"p0": length, "p1": length, "p2": length}
    else:
        assert steps[0] == {"p0": length}
        assert steps[1] == {"p0": 1, "p1": length}  # beside a decode row the budget decides
        assert steps[2] == {"p0": 1, "p1": 1, "p2": length}
    for i, prompt in enumerate(prompts):
        assert_equivalent(outs[f"p{i}"], hf_greedy(tiny_model, prompt, 4), f"p{i}")
    plain = make_engine(tiny_model, num_blocks=256)
    _, plain_steps = run_to_completion(plain, {f"p{i}": (p, params) for i, p in enumerate(prompts)})
    assert plain_steps[0] == {"p0": length, "p1": length, "p2": length}
