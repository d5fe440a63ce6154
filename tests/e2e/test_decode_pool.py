"""The decode pool under pressure, through real processes: a decode worker whose KV pool is too
small for its batch (preemption), 100 cancelled streams, stop strings, CJK/emoji streaming,
max_tokens=1 and logprobs, all through router -> prefill -> decode on loopback."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import pytest
from transformers import AutoTokenizer

from services.common.pb import common_pb2, generate_pb2
from services.engine import LLM, SamplingParams
from tests.e2e.cluster import generate, generation_stub, scrape, start, start_all, worker_info
from tests.engine.helpers import make_engine, run_to_completion
from tests.reference import assert_equivalent, hf_greedy

pytestmark = pytest.mark.e2e

DECODE_BLOCKS = 40  # 32 concurrent requests of up to ~90 tokens need ~100 blocks of 16
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pool():
    prefill, decode = start_all(
        ["prefill", "--port", "0"], ["decode", "--port", "0", "--num-blocks", str(DECODE_BLOCKS)]
    )
    router = start(
        "router",
        "--disaggregation",
        "always",
        "--port",
        "0",
        "--prefill",
        prefill.ready["grpc"],
        "--decode",
        decode.ready["grpc"],
    )
    yield SimpleNamespace(
        prefill=prefill, decode=decode, router=router, stub=generation_stub(router.ready["grpc"])
    )
    for proc in (router, decode, prefill):
        assert proc.stop() == 0


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return AutoTokenizer.from_pretrained(default_model)


def _sampling(max_tokens: int, **kwargs) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, **{**GREEDY, **kwargs})


def _state(pool) -> tuple[int, int, int]:
    """(prefill free blocks, prefill pinned blocks, decode free blocks), from GetInfo."""
    prefill = worker_info(pool.prefill.ready["grpc"], "prefill")
    decode = worker_info(pool.decode.ready["grpc"], "decode")
    return prefill.num_free_blocks, prefill.num_pinned_blocks, decode.num_free_blocks


def _settles_to(pool, expected, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while _state(pool) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return _state(pool) == expected


def test_preempted_decode_batch_keeps_every_output(pool, default_model, real_text_ids):
    prompts = [
        real_text_ids[11000 + 97 * i : 11000 + 97 * i + 5 + (i * 13) % 64] for i in range(32)
    ]
    preemptions = scrape(pool.decode.ready["metrics"], "pdserve_num_preemptions_total", "decode")
    with ThreadPoolExecutor(32) as executor:
        futures = [
            executor.submit(
                generate, pool.stub, token_ids=generate_pb2.TokenIds(ids=p), sampling=_sampling(24)
            )
            for p in prompts
        ]
        outputs = [f.result()[0] for f in futures]
    assert (
        scrape(pool.decode.ready["metrics"], "pdserve_num_preemptions_total", "decode")
        > preemptions
    )
    params = SamplingParams(max_tokens=24, **GREEDY)
    roomy, _ = run_to_completion(
        make_engine(default_model, num_blocks=512),
        {str(i): (p, params) for i, p in enumerate(prompts)},
    )
    for i, (prompt, tokens) in enumerate(zip(prompts, outputs, strict=True)):
        if tokens != roomy[str(i)]:  # batch shapes differ: judge by the equivalence rule
            assert_equivalent(tokens, hf_greedy(default_model, prompt, 24), f"request {i}")
    assert _settles_to(pool, (_state(pool)[0], 0, DECODE_BLOCKS))


def test_hundred_cancelled_streams_leave_no_block_behind(pool, real_text_ids):
    before = _state(pool)
    assert before[1:] == (0, DECODE_BLOCKS)
    rng = random.Random(0)
    plans = [
        (rng.randrange(0, 5), rng.random() * 0.2) for _ in range(100)
    ]  # (messages to read, then sleep)

    def cancelled_stream(i: int) -> None:
        start = 50 * i
        call = pool.stub.Generate(
            generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=real_text_ids[start : start + 20 + i % 40]),
                sampling=_sampling(300),
            ),
            timeout=60,
        )
        messages, pause = plans[i]
        try:
            for _ in range(messages):  # 0: cancel before the first token, maybe mid-prefill
                next(call)
        except grpc.RpcError:
            pass
        time.sleep(pause)
        call.cancel()

    with ThreadPoolExecutor(6) as executor:
        list(executor.map(cancelled_stream, range(100)))
    assert _settles_to(pool, before), (_state(pool), before)


def test_stop_string_spanning_two_tokens_is_never_streamed(pool, tokenizer, real_text_ids):
    prompt = generate_pb2.TokenIds(ids=real_text_ids[400:440])
    tokens, full, _ = generate(pool.stub, token_ids=prompt, sampling=_sampling(30))
    for i in range(3, 25):  # a boundary with two characters on each side
        cut = len(tokenizer.decode(tokens[: i + 1]))
        stop = full[cut - 2 : cut + 2]
        if (
            len(stop) == 4
            and full.index(stop) == cut - 2
            and len(tokenizer.decode(tokens[i + 1 : i + 2])) >= 2
        ):
            break
    else:
        pytest.skip("no token boundary with two characters on each side")
    received = []
    finish = ""
    for msg in pool.stub.Generate(
        generate_pb2.GenerateRequest(token_ids=prompt, sampling=_sampling(30, stop=[stop])),
        timeout=60,
    ):
        received.append(msg.text)
        finish = msg.finish_reason or finish
    assert "".join(received) == full[: cut - 2]
    assert finish == "stop" and all(stop not in chunk for chunk in received)


@pytest.mark.parametrize(
    "prompt",
    ["日本語の文章: 東京は日本の首都です。大阪は", "Emoji list: 🙂 😀 🎉 🚀 🐱 🐶 🍕 🌟 ❤️ 👍 🔥"],
)
def test_cjk_and_emoji_stream_whole_characters(pool, tokenizer, prompt):
    deltas, token_ids = [], []
    for msg in pool.stub.Generate(
        generate_pb2.GenerateRequest(text=prompt, sampling=_sampling(15)), timeout=60
    ):
        deltas.append(msg.text)
        token_ids += msg.token_ids
    text = "".join(deltas)
    assert any(ord(c) > 0x3000 for c in text), text  # the model answered in CJK / emoji
    assert any(
        tokenizer.decode([t]).count("\ufffd") for t in token_ids
    )  # characters split across tokens
    # Every delta is whole characters; only the very end may flush a character cut by max_tokens.
    assert not any("\ufffd" in d for d in deltas[:-1])
    assert text.rstrip("\ufffd") == tokenizer.decode(token_ids).rstrip("\ufffd")


def test_max_tokens_one_returns_exactly_one_token(pool, real_text_ids):
    tokens, _, finish = generate(
        pool.stub, token_ids=generate_pb2.TokenIds(ids=real_text_ids[:30]), sampling=_sampling(1)
    )
    assert len(tokens) == 1 and finish == "length"


def test_logprobs_through_the_cluster_match_the_engine(pool, default_model, real_text_ids):
    prompt = real_text_ids[700:730]
    messages = list(
        pool.stub.Generate(
            generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=prompt), sampling=_sampling(8, logprobs=3)
            ),
            timeout=60,
        )
    )
    tokens = [t for m in messages for t in m.token_ids]
    logprobs = [lp for m in messages for lp in m.logprobs]
    assert all(len(m.logprobs) == len(m.token_ids) for m in messages)
    [expected] = LLM(make_engine(default_model)).generate(
        [prompt], SamplingParams(max_tokens=8, logprobs=3, **GREEDY)
    )
    assert tokens == expected.token_ids
    for got, want in zip(logprobs, expected.logprobs, strict=True):
        assert got.token_id == want.token_id and got.rank == want.rank == 1
        assert got.logprob == pytest.approx(want.logprob, abs=1e-3)
        assert [t.token_id for t in got.top] == [t for t, _ in want.top]


def test_a_request_that_can_never_fit_is_refused_before_any_prefill(pool, real_text_ids):
    before = worker_info(pool.prefill.ready["grpc"], "prefill").num_prompt_tokens_computed
    with pytest.raises(grpc.RpcError) as info:
        generate(
            pool.stub,
            token_ids=generate_pb2.TokenIds(ids=real_text_ids[:30]),
            sampling=_sampling(DECODE_BLOCKS * 16),
        )
    # permanent, so INVALID_ARGUMENT (HTTP 400), never a RESOURCE_EXHAUSTED a client retries
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("max_tokens:") and "never fit" in info.value.details()
    assert worker_info(pool.prefill.ready["grpc"], "prefill").num_prompt_tokens_computed == before
