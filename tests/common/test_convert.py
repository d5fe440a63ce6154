"""Sampling parameters and log-probabilities survive the proto round trip; unset sampling fields
take the engine defaults."""

from __future__ import annotations

import pytest

from services.common.convert import (
    logprobs_from_proto,
    logprobs_to_proto,
    sampling_from_proto,
    sampling_to_proto,
)
from services.common.pb import common_pb2
from services.engine.outputs import TokenLogprobs
from services.engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(max_tokens=3, temperature=0.5, top_p=0.75, top_k=4, seed=9, logprobs=2),
        SamplingParams(
            presence_penalty=-1.5,
            frequency_penalty=0.25,
            repetition_penalty=1.25,
            logit_bias={7: -100.0, 3: 2.5},
            stop_token_ids=(5,),
            ignore_eos=True,
        ),
    ],
)
def test_sampling_round_trip(params):
    msg = common_pb2.SamplingParams.FromString(sampling_to_proto(params).SerializeToString())
    assert sampling_from_proto(msg) == params


def test_unset_fields_take_the_defaults_and_defaults_stay_unset():
    assert sampling_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    msg = sampling_to_proto(SamplingParams())
    assert not any(
        msg.HasField(name)
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")
    )
    assert not msg.logit_bias
    msg = sampling_to_proto(SamplingParams(repetition_penalty=2.0, logit_bias={4: 1.0}))
    assert msg.repetition_penalty == 2.0 and dict(msg.logit_bias) == {4: 1.0}


@pytest.mark.parametrize(
    "fields, name",
    [
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logit_bias={1: 150.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
    ],
)
def test_bad_values_from_the_wire_name_the_field(fields, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        sampling_from_proto(common_pb2.SamplingParams(**fields))


@pytest.mark.parametrize(
    "logprobs",
    [
        TokenLogprobs(7, -0.25, 1, ()),
        TokenLogprobs(3, -1.5, 2, ((5, -0.5), (3, -1.5), (9, -4.0))),  # values float32 holds
    ],
)
def test_logprobs_round_trip(logprobs):
    msg = common_pb2.TokenLogprob.FromString(logprobs_to_proto(logprobs).SerializeToString())
    assert logprobs_from_proto(msg) == logprobs
