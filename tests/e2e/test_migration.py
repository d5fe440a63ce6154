"""Request migration between real processes: a decode worker SIGKILLed or SIGSTOPped
mid-stream, its stream continued on the other decode worker (`services/router/flow/migration.py`).

One prefill worker, two decode workers on fixed ports (a killed one is started again at its
address for the next test), a router with a 2 s stall timeout; SmolLM2, 96-token streams
compared with the transformers reference by the equivalence rule.
"""

from __future__ import annotations

import random
import signal
import time

import grpc
import pytest

from services.common.pb import common_pb2, generate_pb2
from tests.e2e.cluster import free_port, generation_stub, scrape, start, start_all, worker_info
from tests.reference import assert_equivalent, hf_greedy


@pytest.fixture(scope="module")
def tokenizer(default_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model)


NUM_TOKENS = 96  # the SIGKILL streams
SHORT = 96  # the stop-string and SIGSTOP streams
STALL_TIMEOUT_S = 2.0
KV_BYTES = str(96 << 20)


def _decode_args(port: int) -> list[str]:
    return ["decode", "--port", str(port), "--kv-cache-bytes", KV_BYTES, "--drain-timeout", "1"]


@pytest.fixture(scope="module")
def cluster():
    ports = [free_port(), free_port()]
    prefill, *decode = start_all(
        ["prefill", "--kv-cache-bytes", KV_BYTES], *[_decode_args(p) for p in ports]
    )
    router = start(
        "router", "--port", "0", "--disaggregation", "always", "--routing", "round_robin",
        "--stream-stall-timeout", str(STALL_TIMEOUT_S), "--migration-wait", "20",
        "--prefill", prefill.ready["grpc"],
        *[arg for d in decode for arg in ("--decode", d.ready["grpc"])],
    )  # fmt: skip
    state = {"prefill": prefill, "decode": decode, "router": router, "ports": ports}
    yield state
    for proc in [router, *state["decode"], prefill]:
        if proc.process.poll() is None:
            proc.process.send_signal(signal.SIGCONT)
            proc.stop(timeout=30)


def _revive(cluster, index: int) -> None:
    """Starts decode worker `index` again at its old address, once the router sees it."""
    proc = cluster["decode"][index]
    if proc.process.poll() is None:
        return
    cluster["decode"][index] = start(*_decode_args(cluster["ports"][index]))
    _wait_healthy(cluster, cluster["decode"][index].ready["grpc"])


def _wait_healthy(cluster, address: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    url = cluster["router"].ready["metrics"]
    while time.monotonic() < deadline:
        if scrape(url, "pdserve_worker_healthy", "router", worker=address) == 1:
            return
        time.sleep(0.2)
    raise AssertionError(f"the router never saw {address} healthy again")


def _holder(cluster) -> int:
    """The index of the decode worker running a request."""
    for _ in range(100):
        for i, proc in enumerate(cluster["decode"]):
            if worker_info(proc.ready["grpc"], "decode").num_running:
                return i
        time.sleep(0.02)
    raise AssertionError("no decode worker runs the request")


def _stream(cluster, request, fault_at: int | None = None, sig: int = signal.SIGKILL):
    """Streams `request`; once `fault_at` tokens arrived, sends `sig` to the decode worker
    running it. Returns (token ids, text, last message, the longest gap between messages in
    seconds, the index of the faulted worker)."""
    stub = generation_stub(cluster["router"].ready["grpc"])
    tokens, text, last, victim = [], "", None, None
    gap, previous = 0.0, None
    for msg in stub.Generate(request, timeout=180):
        now = time.monotonic()
        if previous is not None and tokens:
            gap = max(gap, now - previous)
        previous = now
        tokens += msg.token_ids
        text += msg.text
        last = msg
        if fault_at is not None and victim is None and len(tokens) >= fault_at:
            victim = _holder(cluster)
            cluster["decode"][victim].process.send_signal(sig)
    return tokens, text, last, gap, victim


def _request(prompt_ids, max_tokens: int = NUM_TOKENS, **sampling) -> generate_pb2.GenerateRequest:
    sampling = {"temperature": 0.0, **sampling}  # greedy unless it says otherwise
    params = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    return generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt_ids), sampling=params
    )


def _no_leaks(cluster) -> None:
    """Every worker's blocks free and nothing pinned (after in-flight frees land)."""
    deadline = time.monotonic() + 10
    while True:
        infos = [worker_info(cluster["prefill"].ready["grpc"], "prefill")] + [
            worker_info(d.ready["grpc"], "decode") for d in cluster["decode"]
        ]
        if all(
            i.num_pinned_blocks == 0 and i.num_running == 0 and i.num_waiting == 0 for i in infos
        ) and all(i.num_free_blocks == i.num_blocks for i in infos[1:]):
            return
        assert time.monotonic() < deadline, [str(i) for i in infos]
        time.sleep(0.2)


def test_sigkilled_decode_worker_greedy_stream_continues(cluster, default_model, real_text_ids):
    prompt = real_text_ids[500:560]
    reference = hf_greedy(default_model, prompt, NUM_TOKENS)
    whole, whole_text, _, _, _ = _stream(cluster, _request(prompt))
    assert_equivalent(whole, reference, context="uninterrupted")
    fault_at = random.Random(18).randrange(20, NUM_TOKENS - 20)
    migrations = scrape(
        cluster["router"].ready["metrics"],
        "pdserve_request_migrations_total",
        "router",
        reason="decode_failed",
    )
    tokens, text, last, _, victim = _stream(cluster, _request(prompt), fault_at)
    assert victim is not None and cluster["decode"][victim].process.wait(timeout=10) == -9
    assert last.finish_reason == "length" and len(tokens) == NUM_TOKENS
    assert_equivalent(tokens, reference, context=f"SIGKILL at token {fault_at}")
    if tokens == whole:
        assert text == whole_text  # the detokenizer's state carried over: no text lost
    assert last.usage.completion_tokens == NUM_TOKENS  # each token counted once
    assert last.timings.migrations == 1 and last.timings.migration > 0
    assert (
        scrape(
            cluster["router"].ready["metrics"],
            "pdserve_request_migrations_total",
            "router",
            reason="decode_failed",
        )
        == migrations + 1
    )
    _revive(cluster, victim)
    _no_leaks(cluster)


def test_sigkilled_decode_worker_seeded_stream_is_the_same(cluster, real_text_ids):
    prompt = real_text_ids[900:940]
    sampling = dict(temperature=0.8, top_p=0.95, seed=1234, frequency_penalty=0.3)
    whole, whole_text, _, _, _ = _stream(cluster, _request(prompt, **sampling))
    fault_at = random.Random(19).randrange(20, NUM_TOKENS - 20)
    tokens, text, last, _, victim = _stream(cluster, _request(prompt, **sampling), fault_at)
    assert victim is not None and last.timings.migrations == 1
    assert tokens == whole and text == whole_text, f"seeded stream differs after token {fault_at}"
    _revive(cluster, victim)
    _no_leaks(cluster)


def test_stop_string_straddling_the_migration_is_caught(cluster, tokenizer, real_text_ids):
    prompt = real_text_ids[1300:1350]
    whole, _, _, _, _ = _stream(cluster, _request(prompt, SHORT))
    fault_at = 60
    # A stop string from a few tokens before the fault to well after it: wherever the router
    # was when the worker died (a few tokens past what the client had), it straddles.
    stop = tokenizer.decode(whole[fault_at - 3 : fault_at + 25])
    assert stop not in tokenizer.decode(whole[: fault_at + 24])
    tokens, text, last, _, victim = _stream(cluster, _request(prompt, SHORT, stop=[stop]), fault_at)
    assert victim is not None and last.timings.migrations == 1
    assert last.finish_reason == "stop"
    assert tokens == whole[: fault_at + 25] and stop not in text
    assert text == tokenizer.decode(whole[: fault_at + 25]).removesuffix(stop)
    _revive(cluster, victim)
    _no_leaks(cluster)


def test_sigstopped_decode_worker_streams_move_within_the_stall_timeout(
    cluster, default_model, real_text_ids
):
    prompt = real_text_ids[1700:1760]
    reference = hf_greedy(default_model, prompt, SHORT)
    tokens, _, last, gap, victim = _stream(cluster, _request(prompt, SHORT), 60, signal.SIGSTOP)
    stopped = cluster["decode"][victim]
    try:
        assert_equivalent(tokens, reference, context="SIGSTOP at token 60")
        assert last.timings.migrations == 1
        # no token for the stall timeout, plus the health checker's 2 failed checks (0.5 s
        # apart, 1 s timeout each), plus the re-prefill on a busy 2-core machine
        assert STALL_TIMEOUT_S <= gap < STALL_TIMEOUT_S + 2 * 1.5 + 5, gap
        assert (
            scrape(
                cluster["router"].ready["metrics"],
                "pdserve_request_migrations_total",
                "router",
                reason="decode_stalled",
            )
            >= 1
        )
    finally:
        stopped.process.send_signal(signal.SIGCONT)
    _wait_healthy(cluster, stopped.ready["grpc"])  # it rejoins
    _no_leaks(cluster)  # its cancelled stream freed its blocks once it ran again
    # and it serves again
    stub = generation_stub(cluster["router"].ready["grpc"])
    for _ in range(2):  # round robin: one of these lands on it
        answer = list(stub.Generate(_request(prompt[:20], max_tokens=4), timeout=60))
        assert answer[-1].finish_reason == "length"


def test_max_migrations_zero_fails_fast_naming_the_worker(real_text_ids):
    """--max-migrations 0: a killed decode worker's stream ends UNAVAILABLE naming it."""
    prefill, decode = start_all(
        ["prefill", "--kv-cache-bytes", KV_BYTES], _decode_args(free_port())
    )
    router = start(
        "router", "--port", "0", "--disaggregation", "always", "--max-migrations", "0",
        "--prefill", prefill.ready["grpc"], "--decode", decode.ready["grpc"],
    )  # fmt: skip
    try:
        one = {"prefill": prefill, "decode": [decode], "router": router}
        with pytest.raises(grpc.RpcError) as info:
            _stream(one, _request(real_text_ids[:30]), 10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert decode.ready["grpc"] in info.value.details()
        assert "after 0 migration(s)" in info.value.details()
    finally:
        for proc in (router, decode, prefill):
            proc.stop(timeout=30)
