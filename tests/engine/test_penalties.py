"""Logit bias and the repetition, frequency and presence penalties: validation and the sampler's
math on hand-made logits (vLLM's definitions and order, services/engine/penalties.py)."""

from __future__ import annotations

import pytest
import torch

from services.engine import SamplingParams
from services.engine import sampler as sampler_module
from services.engine.errors import InvalidRequestError
from services.engine.penalties import apply_penalties
from services.engine.sampler import SamplingRow, sample
from tests.engine.helpers import GREEDY, make_engine


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(presence_penalty=3), "presence_penalty: must be in [-2, 2], got 3"),
        (dict(presence_penalty=-2.5), "presence_penalty: must be in [-2, 2], got -2.5"),
        (dict(frequency_penalty=2.01), "frequency_penalty: must be in [-2, 2], got 2.01"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty: must be in [-2, 2], got nan"),
        (dict(presence_penalty="1"), "presence_penalty: must be in [-2, 2], got '1'"),
        (dict(repetition_penalty=0), "repetition_penalty: must be a finite number > 0, got 0"),
        (dict(repetition_penalty=-1.0), "repetition_penalty: must be a finite number > 0"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty: must be a finite number"),
        (dict(logit_bias={3: 101}), "logit_bias: must be in [-100, 100], got 101 for token 3"),
        (dict(logit_bias={3: float("nan")}), "logit_bias: must be in [-100, 100], got nan"),
        (dict(logit_bias={-1: 1.0}), "logit_bias: token ids must be non-negative integers"),
        (dict(logit_bias={"5": 1.0}), "logit_bias: token ids must be non-negative integers"),
        (dict(logit_bias={True: 1.0}), "logit_bias: token ids must be non-negative integers"),
        (dict(logit_bias=[(3, 1.0), (3, 2.0)]), "logit_bias: a token id appears twice"),
        (dict(logit_bias=5), "logit_bias: must map token ids to biases"),
        (dict(logit_bias=[(1, 2, 3)]), "logit_bias: must map token ids to biases"),
    ],
)
def test_out_of_range_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith(message)


def test_ranges_are_inclusive_and_logit_bias_is_stored_frozen():
    params = SamplingParams(
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=7.5,
        logit_bias={9: 100, 2: -100},
    )
    assert params.logit_bias == ((2, -100.0), (9, 100.0))
    assert params == SamplingParams(
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=7.5,
        logit_bias=[(9, 100), (2, -100)],
    )
    assert hash(params) == hash(
        SamplingParams(
            logit_bias={2: -100, 9: 100},
            **{
                k: getattr(params, k)
                for k in ("presence_penalty", "frequency_penalty", "repetition_penalty")
            },
        )
    )
    assert params.adjusts_logits and not SamplingParams().adjusts_logits
    assert SamplingParams(repetition_penalty=1.01).adjusts_logits


def test_sampling_rows_carry_the_requests_own_histories(tiny_llama):
    """The scheduler hands the sampler the request's lists themselves, not copies."""
    engine = make_engine(tiny_llama, num_blocks=16)
    rid = engine.add_request([3, 4, 5], SamplingParams(max_tokens=3, presence_penalty=1.0))
    engine.step()
    request = engine.requests[rid]
    (item,) = engine.scheduler.schedule().scheduled
    assert item.sample is not None and item.sample.output_index == 1
    assert item.sample.prompt_token_ids is request.prompt_token_ids
    assert item.sample.output_token_ids is request.output_token_ids


def test_admission_checks_logit_bias_ids_against_the_vocabulary(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=16)
    with pytest.raises(
        InvalidRequestError, match=r"^logit_bias: token ids \[512\] outside \[0, 512\)"
    ):
        engine.add_request([3, 4], SamplingParams(logit_bias={511: 1.0, 512: 1.0}))
    assert not engine.has_unfinished_requests()


def _apply(logits, prompt=(), output=(), **params):
    return apply_penalties(torch.tensor(logits), SamplingParams(**params), prompt, output).tolist()


def test_each_penalty_alone():
    logits = [2.0, -1.0, 0.5, 3.0, -4.0]
    # Repetition: tokens of the prompt or the output; positive logits divided, others multiplied.
    assert _apply(logits, [0, 1], [4, 4], repetition_penalty=2.0) == [1.0, -2.0, 0.5, 3.0, -8.0]
    assert _apply(logits, [0], [], repetition_penalty=0.5) == [4.0, -1.0, 0.5, 3.0, -4.0]
    # Frequency: once per occurrence in the output; the prompt does not count.
    assert _apply(logits, [2, 2], [0, 0, 1], frequency_penalty=1.5) == [-1.0, -2.5, 0.5, 3.0, -4.0]
    # Presence: once per token in the output, however often it occurs.
    assert _apply(logits, [2], [0, 0, 1], presence_penalty=0.5) == [1.5, -1.5, 0.5, 3.0, -4.0]
    assert _apply(logits, [2], [0, 0], presence_penalty=-1.0) == [3.0, -1.0, 0.5, 3.0, -4.0]
    # Logit bias: added as it is.
    assert _apply(logits, [0], [1], logit_bias={3: -100, 2: 1.5}) == [2.0, -1.0, 2.0, -97.0, -4.0]
    # Nothing in the history: only the bias can act.
    assert _apply(logits, [], [], presence_penalty=2, frequency_penalty=2) == logits


def test_combined_in_vllms_order():
    """Bias first, then repetition (on the biased logit), then frequency, then presence."""
    got = _apply(
        [1.0, 1.0, -1.0, 0.0],
        prompt=[0],
        output=[1, 1, 2],
        logit_bias={0: 1.0, 2: 3.0},
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    # token 0: (1 + 1) / 2; token 1: 1 / 2 - 0.5 * 2 - 0.25; token 2: (-1 + 3) / 2 - 0.5 - 0.25
    assert got == [1.0, -0.75, 0.25, 0.0]


def _row(params: SamplingParams, prompt=(), output=(), seed=0) -> SamplingRow:
    return SamplingRow(params, seed, len(output), prompt, output)


def test_greedy_rows_take_the_argmax_after_penalties():
    logits = torch.tensor([[3.0, 2.5, 0.0], [3.0, 2.5, 0.0], [3.0, 2.5, 0.0]])
    rows = [
        _row(SamplingParams(**GREEDY), prompt=[0]),  # plain: the raw argmax
        _row(SamplingParams(repetition_penalty=1.5, **GREEDY), prompt=[0]),  # 3 / 1.5 < 2.5
        _row(SamplingParams(logit_bias={2: 5.0}, **GREEDY)),
    ]
    assert sample(logits, rows)[0] == [0, 1, 2]


def test_sampled_rows_draw_from_the_penalised_distribution():
    logits = torch.zeros(1, 8)
    banned = {t: -100.0 for t in range(7)}
    tokens = [
        sample(logits, [_row(SamplingParams(logit_bias=banned, seed=s), seed=s)])[0][0]
        for s in range(20)
    ]
    assert tokens == [7] * 20
    # top_k=1 after the penalties picks the penalised argmax.
    row = _row(SamplingParams(frequency_penalty=1.0, top_k=1), output=[3, 3])
    assert sample(torch.tensor([[0.5, 0.0, 0.0, 1.5]]), [row])[0] == [0]


def test_logprobs_stay_those_of_the_raw_logits():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    row = _row(SamplingParams(logit_bias={2: 10.0}, logprobs=2, **GREEDY))
    (token,), (lp,) = sample(logits, [row])
    raw = torch.log_softmax(logits[0], -1)
    assert token == 2 and lp is not None
    assert lp.logprob == pytest.approx(float(raw[2])) and lp.rank == 3
    assert [t for t, _ in lp.top] == [0, 1]


def test_plain_rows_skip_the_penalty_stage_and_logits_stay_untouched(monkeypatch):
    calls = []

    def counting(logits, params, prompt, output):
        calls.append(params)
        return apply_penalties(logits, params, prompt, output)

    monkeypatch.setattr(sampler_module, "apply_penalties", counting)
    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    penalised = SamplingParams(presence_penalty=2.0, **GREEDY)
    rows = [
        _row(SamplingParams(**GREEDY), [1], [2]),
        _row(penalised, [1], [int(logits[1].argmax())]),
        _row(SamplingParams(seed=3), [1], [2], seed=3),
        _row(SamplingParams(**GREEDY, logprobs=1), [1], [2]),
    ]
    tokens, _ = sample(logits, rows)
    assert calls == [penalised]
    assert torch.equal(logits, before)
    assert tokens[0] == int(logits[0].argmax()) and tokens[3] == int(logits[3].argmax())
    assert tokens[1] != int(logits[1].argmax())  # its argmax was seen once: presence moved it


def test_each_row_of_a_mixed_batch_gets_the_token_it_gets_alone():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 64, generator=generator) * 3
    plain = logits.argmax(-1).tolist()
    # Every history holds its row's raw argmax twice, so a penalty has something to act on.
    history = [
        h + [plain[i]] * 2
        for i, h in enumerate(torch.randint(0, 64, (8, 10), generator=generator).tolist())
    ]
    kinds = [
        dict(**GREEDY),
        dict(repetition_penalty=2.0, **GREEDY),
        dict(presence_penalty=1.5, frequency_penalty=1.5, **GREEDY),
        dict(logit_bias={plain[3]: -20.0, 9: 3.0}, **GREEDY),
        dict(seed=11, temperature=0.8),
        dict(seed=12, temperature=0.7, top_p=0.9, repetition_penalty=1.3, frequency_penalty=1.0),
        dict(seed=13, top_k=5, logit_bias={1: 2.0}, presence_penalty=-1.0),
        dict(repetition_penalty=0.6, frequency_penalty=-0.5, **GREEDY),
    ]
    rows = [
        _row(SamplingParams(**kind), prompt=h[:6], output=h[6:], seed=kind.get("seed", 0))
        for kind, h in zip(kinds, history, strict=True)
    ]
    together, _ = sample(logits, rows)
    alone = [sample(logits[i : i + 1], [row])[0][0] for i, row in enumerate(rows)]
    assert together == alone
    assert together[0] == plain[0] and together[7] == plain[7]  # plain; repeats encouraged
    assert all(together[i] != plain[i] for i in (1, 2, 3))  # the penalised greedy rows moved
