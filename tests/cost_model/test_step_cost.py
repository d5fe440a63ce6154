"""The step cost model: features of a step's shape, a fit that recovers known coefficients."""

from __future__ import annotations

import random

import pytest

from services.cost_model.step_cost import StepCost, StepShape, busiest_thread_context, fit

# Seconds per unit: a 135M-model-like CPU engine (2 ms fixed, 0.4 ms a token, attention and
# context small, 0.1 ms a decode row, 2 us a cached token a chunk reads).
KNOWN = (2e-3, 4e-4, 2e-8, 3e-7, 1e-4, 5e-3, 2e-6)


def _steps(rng: random.Random, n: int) -> list[StepShape]:
    shapes = []
    for _ in range(n):
        chunks = tuple(
            (rng.randint(1, 512), rng.choice([0, 0, rng.randint(1, 2048)]))
            for _ in range(rng.choice([0, 0, 1, 2]))
        )
        decodes = tuple(rng.randint(1, 4096) for _ in range(rng.randint(0 if chunks else 1, 32)))
        shapes.append(StepShape(chunks, decodes))
    return shapes


def test_features_of_a_mixed_step():
    shape = StepShape(chunks=((100, 0), (50, 200)), decode_contexts=(10, 30))
    # a fresh prompt's causal kernel computes half its square, a chunk after a cache the rectangle
    assert shape.features() == (1.0, 150, 100 * 100 / 2 + 50 * 250, 40, 2, 1.0, 200)
    # short rows: one part each, a thread each
    assert shape.features(threads=2)[3] == 30 and shape.features(threads=8)[3] == 30
    assert StepShape(decode_contexts=(64,)).features(threads=4)[3:] == (64, 1, 0.0, 0)


def test_the_context_feature_follows_the_decode_kernels_split():
    """The busiest thread's context: whole rows in consecutive runs from one a thread, else parts
    of at least 256 positions (whole 16-token blocks), each to the thread free first."""
    assert busiest_thread_context((), 2) == 0.0
    assert busiest_thread_context((2048,), 1) == 2048
    assert busiest_thread_context((2048,), 2) == 1024  # 4 parts of 512, two a thread
    assert busiest_thread_context((300,), 2) == 256  # parts of 256 and 44
    assert busiest_thread_context((100, 200, 300, 400), 2) == 700  # rows: 100+200 | 300+400
    assert busiest_thread_context((100, 200, 300), 2) == 300  # 100+200 | 300
    assert busiest_thread_context((2048, 16), 2) == 2048  # a row a thread: whole rows
    # fewer rows than threads: parts of 352 (2,064 / 6, in whole blocks), two on the busiest
    assert busiest_thread_context((2048, 16), 3) == 704


@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_the_fit_recovers_known_coefficients(noise):
    rng = random.Random(7)
    shapes = _steps(rng, 400)
    truth = StepCost(2, KNOWN)
    seconds = [truth.predict(s) * (1 + rng.uniform(-noise, noise)) for s in shapes]
    fitted = fit(2, shapes, seconds)
    for got, want in zip(fitted.coefficients, KNOWN, strict=True):
        assert got == pytest.approx(want, rel=0.01 if noise == 0 else 0.15)
    errors = sorted(abs(fitted.predict(s) - t) / t for s, t in zip(shapes, seconds, strict=True))
    assert errors[len(errors) // 2] <= max(noise, 1e-9)  # median relative error within the noise


def test_a_feature_no_step_exercised_stays_zero():
    shapes = [StepShape(decode_contexts=tuple(range(1, b + 1))) for b in range(1, 40)]
    seconds = [StepCost(1, KNOWN).predict(s) for s in shapes]
    fitted = fit(1, shapes, seconds)
    assert fitted.coefficients[2] == 0.0  # no prefill chunk: no attention term
    assert fitted.predict(shapes[10]) == pytest.approx(seconds[10], rel=1e-6)


@pytest.mark.parametrize(
    ("shapes", "seconds", "field"),
    [
        ([StepShape(decode_contexts=(5,))] * 3, [0.01] * 3, "shapes"),  # one shape, 3 terms
        ([StepShape(decode_contexts=(5,))], [0.01, 0.02], "seconds"),
        ([StepShape(decode_contexts=(5,))], [0.0], "seconds"),
    ],
)
def test_a_fit_that_cannot_be_determined_names_the_field(shapes, seconds, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        fit(1, shapes, seconds)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({}, "chunks"),
        ({"chunks": ((0, 0),)}, "chunks"),
        ({"chunks": ((4, -1),)}, "chunks"),
        ({"decode_contexts": (0,)}, "decode_contexts"),
    ],
)
def test_a_bad_shape_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        StepShape(**kwargs)
