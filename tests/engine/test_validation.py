"""Bad input is refused with an error naming the field; the engine stays usable afterwards."""

from __future__ import annotations

from dataclasses import fields

import pytest
from transformers import MistralConfig, MistralForCausalLM

from services.engine import LLM, Engine, EngineConfig, SamplingParams
from services.engine.errors import InvalidRequestError, ResourceExhaustedError
from services.engine.sampling_params import check_stop_strings
from tests.engine.helpers import GREEDY, make_engine
from tests.reference import assert_equivalent, hf_greedy

BAD_SAMPLING = [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature="0.5"), "temperature"),
    (dict(seed=1.5), "seed"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids"),
    # What the worker protocol cannot carry (int32 counts and ids, a uint64 seed, float32s).
    (dict(max_tokens=2**31), "max_tokens"),
    (dict(top_k=2**31), "top_k"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**64), "seed"),
    (dict(stop_token_ids=(2**31,)), "stop_token_ids"),
    (dict(temperature=1e39), "temperature"),
    (dict(temperature=10**400), "temperature"),  # too large for a float: refused, not raised
    (dict(repetition_penalty=1e39), "repetition_penalty"),
    (dict(logit_bias={2**31: 1.0}), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(1025)}), "logit_bias"),
    (dict(ignore_eos=1), "ignore_eos"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=True), "logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty="0"), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(logit_bias={1: 101}), "logit_bias"),
]


@pytest.mark.parametrize("kwargs, field", BAD_SAMPLING)
def test_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_every_sampling_field_is_checked():
    """SamplingParams is the one place sampling values are validated: each field has a case."""
    assert {field for _, field in BAD_SAMPLING} == {f.name for f in fields(SamplingParams)}


def test_the_widest_values_the_wire_carries_are_accepted():
    params = SamplingParams(
        max_tokens=2**31 - 1, top_k=2**31 - 1, seed=2**64 - 1, stop_token_ids=(2**31 - 1,)
    )
    assert (params.max_tokens, params.seed) == (2**31 - 1, 2**64 - 1)
    assert SamplingParams(logit_bias={i: 1.0 for i in range(1024)}).adjusts_logits


@pytest.mark.parametrize(
    "stop, message",
    [
        ([""], "stop: stop strings must not be empty"),
        ("x", "stop: must be a list of strings"),
        ([b"x"], "stop: must be a list of strings"),
    ],
)
def test_stop_strings_name_the_field(stop, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        check_stop_strings(stop)
    assert check_stop_strings(["a", "bc"]) == ("a", "bc")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(block_size=0), "block_size"),
        (dict(dtype="float64"), "dtype"),
        (dict(device="tpu"), "device"),
        (dict(num_blocks=0), "num_blocks"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(engine_id=""), "engine_id"),
    ],
)
def test_engine_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        EngineConfig(**kwargs)


def test_bad_requests_are_refused_and_leave_no_trace(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=8, max_model_len=64)
    free = engine.kv_cache.pool.num_free_blocks
    cases = [
        ([], SamplingParams(), "prompt"),
        (list(range(2, 70)), SamplingParams(), "prompt"),
        ([1, 2, 512], SamplingParams(), "prompt_token_ids"),
        ([1, -1], SamplingParams(), "prompt_token_ids"),
        ([3.7, 4], SamplingParams(), "prompt_token_ids"),
        ([True, 5], SamplingParams(), "prompt_token_ids"),
        ([3, 4], SamplingParams(stop_token_ids=(600,)), "stop_token_ids"),
    ]
    for prompt, params, field in cases:
        with pytest.raises(InvalidRequestError, match=f"^{field}:") as info:
            engine.add_request(prompt, params)
        assert info.value.field == field
    with pytest.raises(InvalidRequestError, match="^prompt:"):
        engine.add_request("text needs a tokenizer", SamplingParams())
    with pytest.raises(
        ResourceExhaustedError
    ):  # 38 + 4 tokens need 3 blocks of 16; the cache has 2
        make_engine(tiny_llama, num_blocks=2).add_request(
            list(range(2, 40)), SamplingParams(max_tokens=4)
        )
    engine.add_request([3, 4], SamplingParams(max_tokens=2), request_id="dup")
    with pytest.raises(InvalidRequestError, match="^request_id:"):
        engine.add_request([3, 4], SamplingParams(max_tokens=2), request_id="dup")
    engine.abort("dup")
    (ok,) = [o for o in LLM(engine).generate([[5, 6, 7]], SamplingParams(max_tokens=3, **GREEDY))]
    assert len(ok.token_ids) == 3
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache.pool.num_free_blocks == free


def test_unsupported_architecture_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(
        tmp_path
    )
    with pytest.raises(ValueError, match="^model: architecture 'gpt2'"):
        Engine(EngineConfig(model=str(tmp_path)))


def test_unknown_model_name_is_refused():
    with pytest.raises(ValueError, match="^model:"):
        Engine(EngineConfig(model="no-such-model"))


def test_mistral_sliding_window(tmp_path):
    """A sliding window shorter than max_model_len is refused; within the window it is exact."""
    import torch

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        sliding_window=64,
        initializer_range=0.2,
    )
    MistralForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="^max_model_len: .*sliding window"):
        Engine(EngineConfig(model=str(tmp_path)))
    engine = make_engine(str(tmp_path), num_blocks=64, max_model_len=64)
    prompt = list(range(5, 40))
    (out,) = LLM(engine).generate([prompt], SamplingParams(max_tokens=20, **GREEDY))
    assert_equivalent(out.token_ids, hf_greedy(str(tmp_path), prompt, 20), "mistral")


def test_vanishing_temperature_is_greedy(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=64)
    (greedy,) = LLM(engine).generate([[4, 5, 6]], SamplingParams(max_tokens=8, **GREEDY))
    (tiny,) = LLM(engine).generate(
        [[4, 5, 6]], SamplingParams(max_tokens=8, temperature=1e-40, ignore_eos=True)
    )
    assert tiny.token_ids == greedy.token_ids


def test_generate_refuses_when_it_would_swallow_other_requests(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=64)
    engine.add_request([4, 5], SamplingParams(max_tokens=2), request_id="mine")
    with pytest.raises(InvalidRequestError, match="^generate:"):
        LLM(engine).generate([[4, 5, 6]], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="^request_id:"):
        engine.add_request([4, 5], SamplingParams(max_tokens=2), request_id="")


def test_kv_memory_budget_must_hold_a_block(tiny_llama):
    with pytest.raises(ValueError, match="^kv_cache_memory_bytes:"):
        make_engine(tiny_llama, block_size=4096, kv_cache_memory_bytes=1 << 20)


def test_generate_is_all_or_nothing(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=64)
    with pytest.raises(InvalidRequestError, match="^prompt_token_ids:"):
        LLM(engine).generate([[3, 4, 5], [10**6]], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests() and engine.kv_cache.pool.num_used_blocks == 0
    with pytest.raises(InvalidRequestError, match="^sampling_params:"):
        LLM(engine).generate([[3], [4], [5]], [SamplingParams(max_tokens=2)])
    (out,) = LLM(engine).generate([[3, 4, 5]], SamplingParams(max_tokens=2))
    assert len(out.token_ids) == 2


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(block_size=2.5), "block_size"),
        (dict(block_size=True), "block_size"),
        (dict(seed=1.5), "seed"),
        (dict(max_model_len=100.5), "max_model_len"),
        (dict(kv_lease_seconds=0), "kv_lease_seconds"),
        (dict(device="tpu"), "device"),
    ],
)
def test_engine_config_types(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        EngineConfig(**kwargs)


def test_cuda_device_without_cuda_is_refused_when_the_engine_starts(tiny_llama):
    """A config is a plain description (the Ray driver builds GPU workers' configs on a machine
    that may have no GPU); the engine that would run it refuses a missing device."""
    if __import__("torch").cuda.is_available():
        pytest.skip("CUDA present")
    config = EngineConfig(model=tiny_llama, device="cuda")
    with pytest.raises(ValueError, match="^device:"):
        Engine(config)
