"""The per-step token budget: a step that mixes prompt tokens into running decodes takes the
largest chunk whose predicted time fits the tightest ITL objective (a hand-made cost model)."""

from __future__ import annotations

import random

import pytest

from services.cost_model.step_cost import StepCost
from services.engine import SamplingParams
from services.engine.errors import InvalidRequestError
from services.engine.step_budget import StepBudget
from tests.engine.helpers import GREEDY, make_engine
from tests.reference import assert_equivalent, hf_greedy

# 10 ms a step, 1 ms a prompt token, 1 ms a decode row; attention and context free.
FAKE = StepCost(1, (0.010, 0.001, 0.0, 0.0, 0.001, 0.0))


@pytest.mark.parametrize(
    ("decodes", "itl_s", "cap", "expected"),
    [
        ((100, 200, 300, 400), 0.050, 1000, 36),  # 10 + 4 + n <= 50
        ((100,), 0.050, 20, 20),  # the cap binds
        ((), 0.001, 500, 500),  # no decode row: nobody is delayed
        ((100,) * 45, 0.050, 1000, 16),  # nothing fits: a prompt still advances 16 tokens
        ((100,) * 4, 0.050, 8, 8),  # ... but never beyond the cap
    ],
)
def test_the_largest_chunk_that_fits(decodes, itl_s, cap, expected):
    assert StepBudget(FAKE).prefill_tokens(decodes, 0, itl_s, cap) == expected


def test_attention_over_cached_context_shrinks_the_chunk():
    cost = StepCost(1, (0.010, 0.001, 1e-5, 0.0, 0.001, 0.0))
    fresh = StepBudget(cost).prefill_tokens((50,), 0, 0.050, 1000)
    after_cache = StepBudget(cost).prefill_tokens((50,), 2000, 0.050, 1000)
    assert 16 <= after_cache < fresh < 39  # 10 + 1 + n + 1e-2 * n * (cached + n) <= 50


def _prompts(lens, seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(2, 512) for _ in range(n)] for n in lens]


def test_mixed_steps_follow_the_tightest_objective_and_greedy_output_is_unchanged(tiny_model):
    """A stream with the engine's 40 ms objective decodes; a second stream asks for 31 ms; then
    a 120-token prompt arrives. Each mixed step's chunk is what the fake model lets fit the
    tightest running objective, a step with no decode row is uncapped, and every output
    equals the reference."""
    engine = make_engine(tiny_model, num_blocks=256, slo_itl_ms=40.0)
    engine.use_step_cost(FAKE)
    first, second, late = _prompts([20, 24, 120])
    engine.add_request(first, SamplingParams(max_tokens=30, **GREEDY), request_id="first")
    engine.step()
    assert engine.last_forward_tokens == {"first": 20}  # no decode row: uncapped
    assert engine.scheduler.last_prefill_budget is None
    engine.add_request(
        second, SamplingParams(max_tokens=30, **GREEDY), request_id="second",
        itl_objective_s=0.031,
    )  # fmt: skip
    engine.step()  # "first" decodes: 10 + 1 + n <= 40 leaves 29, and all 24 fit
    assert engine.last_forward_tokens == {"first": 1, "second": 24}
    assert engine.scheduler.last_prefill_budget == 29
    engine.add_request(late, SamplingParams(max_tokens=8, **GREEDY), request_id="late")
    outs: dict[str, list[int]] = {}
    steps = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.output_token_ids
        steps.append(dict(engine.last_forward_tokens))
        engine.check_integrity()
    # both decode, "second" the tightest: 10 + 2 + n <= 31 leaves 19 prompt tokens a step
    late_chunks = [s["late"] for s in steps if s.get("late", 0) > 1]
    assert late_chunks == [19] * 6 + [6]
    assert all(s.get("first") == 1 and s.get("second") == 1 for s in steps[:7])
    for rid, prompt, n in (("first", first, 30), ("second", second, 30), ("late", late, 8)):
        assert_equivalent(outs[rid], hf_greedy(tiny_model, prompt, n), rid)


def test_an_objective_must_be_positive(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=16)
    with pytest.raises(InvalidRequestError, match="itl_objective_s"):
        engine.add_request([3, 4], SamplingParams(max_tokens=2), itl_objective_s=0)
    with pytest.raises(ValueError, match=r"^slo_itl_ms: must be > 0 milliseconds"):
        make_engine(tiny_llama, num_blocks=16, slo_itl_ms=-1)
