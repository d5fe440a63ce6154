"""KV transfer under faults, with real processes: leases, handshakes, SIGKILL mid-transfer,
stalls, and random cancels. A prefill worker started with the (hidden) `--debug-kv-stall-seconds`
holds every PullKV that long before its first chunk, so a transfer is reliably in flight."""

from __future__ import annotations

import random
import re
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from services.common.pb import common_pb2, generate_pb2, worker_pb2, worker_pb2_grpc
from services.kv_transfer.shared_memory.segment import count_segments
from tests.e2e.cluster import generation_stub, start, start_all, worker_info
from tests.reference import assert_equivalent, hf_greedy

pytestmark = pytest.mark.e2e

LEASE_S = 2.0
STALL_S = 4.0


def _wait(predicate, timeout: float, what: str = "condition") -> float:
    """Seconds until `predicate()` held (AssertionError after `timeout`)."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"{what} not met within {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - start


def _metric(proc, name: str, **labels) -> float:
    text = urllib.request.urlopen(proc.ready["metrics"], timeout=5).read().decode()
    want = "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    for line in text.splitlines():
        if line.startswith(name + want + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name}{want}")


def _prefill(
    proc, request_id: str, prompt: list[int], max_tokens: int = 8
) -> worker_pb2.PrefillResponse:
    stub = worker_pb2_grpc.PrefillStub(grpc.insecure_channel(proc.ready["grpc"]))
    return stub.Prefill(
        worker_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True
            ),
        ),
        timeout=60,
    )


def _decode(
    proc, request_id: str, prompt: list[int], handle, max_tokens: int = 8, timeout: float = 60
) -> list[int]:
    """The decode worker's tokens (after the prefill's first one)."""
    stub = worker_pb2_grpc.DecodeStub(grpc.insecure_channel(proc.ready["grpc"]))
    request = worker_pb2.DecodeRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        kv_handle=handle,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    return [t for reply in stub.Decode(request, timeout=timeout) for t in reply.token_ids]


def _generate(router, prompt: list[int], max_tokens: int = 8, timeout: float = 60) -> list[int]:
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    return [
        t
        for msg in generation_stub(router.ready["grpc"]).Generate(request, timeout=timeout)
        for t in msg.token_ids
    ]


def _lease_lapses(prefill) -> float:
    """The prefill worker's count of leases that lapsed (0 before the first)."""
    try:
        return _metric(
            prefill, "pdserve_kv_transfer_failures_total", role="prefill", reason="lease_expired"
        )
    except KeyError:
        return 0.0


def _pinned(proc) -> int:
    return worker_info(proc.ready["grpc"], "prefill").num_pinned_blocks


def _free(proc, role: str) -> int:
    info = worker_info(proc.ready["grpc"], role)
    return info.num_free_blocks


def _stop(*procs) -> None:
    for proc in procs:
        proc.stop(signal.SIGKILL)


# -- one prefill worker (2 s lease, 4 s stall) and decode workers driven directly ---------------


@pytest.fixture(scope="module")
def direct(default_model):
    prefill, decode, decode_block32, decode_bf16 = start_all(
        ["prefill", "--kv-lease-seconds", str(LEASE_S), "--debug-kv-stall-seconds", str(STALL_S)],
        [
            "decode",
            "--num-blocks",
            "10",
            "--kv-transfer-timeout",
            "20",
        ],  # 160 tokens: room for one prompt
        ["decode", "--block-size", "32"],
        ["decode", "--dtype", "bfloat16"],
    )
    yield prefill, decode, decode_block32, decode_bf16
    _stop(prefill, decode, decode_block32, decode_bf16)


def test_a_request_queued_for_blocks_keeps_its_lease_alive(direct, real_text_ids, default_model):
    """The decode worker has room for one prompt. While the first request's transfer stalls (4 s,
    twice the 2 s lease) the second waits for blocks; its prefill pin survives only because the
    decode worker renews the lease, and both answers are right."""
    prefill, decode, *_ = direct
    prompts = {"q1": real_text_ids[:100], "q2": real_text_ids[200:300]}  # 7 blocks each, 10 in all
    handles = {rid: _prefill(prefill, rid, p).kv_handle for rid, p in prompts.items()}
    with ThreadPoolExecutor(2) as pool:
        futures = {
            rid: pool.submit(_decode, decode, rid, prompts[rid], handles[rid]) for rid in prompts
        }
        time.sleep(0.5)
        assert (
            worker_info(decode.ready["grpc"], "decode").num_waiting == 2
        )  # one reserved, one queued
        results = {
            rid: [handles[rid].first_token_id, *f.result(timeout=60)] for rid, f in futures.items()
        }
    for rid, prompt in prompts.items():
        assert_equivalent(results[rid], hf_greedy(default_model, prompt, 8), context=rid)
    assert (
        _metric(
            prefill, "pdserve_kv_transfer_failures_total", role="prefill", reason="lease_expired"
        )
        == 0
    )
    _wait(lambda: _pinned(prefill) == 0, 5, "pins released")
    assert _free(decode, "decode") == 10


def test_a_caller_that_gives_up_mid_transfer_frees_the_decode_blocks_at_once(direct, real_text_ids):
    """The caller's 1 s deadline passes while the pull is stalled (4 s): the decode worker cancels
    the pull and frees the reserved blocks then, not when the stall or its own timeout ends."""
    prefill, decode, *_ = direct
    prompt = real_text_ids[800:880]
    handle = _prefill(prefill, "impatient", prompt).kv_handle
    with pytest.raises(grpc.RpcError) as err:
        _decode(decode, "impatient", prompt, handle, timeout=1.0)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _wait(lambda: _free(decode, "decode") == 10, 3, "decode blocks freed") < 1.5
    # The decode worker gave the KV up, so it told the prefill worker to unpin (no lease lapse).
    _wait(lambda: _pinned(prefill) == 0, LEASE_S, "the pin released")


def test_a_hung_decode_worker_cannot_hold_prefill_blocks_past_the_lease(direct, real_text_ids):
    """SIGSTOP the decode worker mid-transfer: its renewals stop, the lease lapses and the prefill
    worker frees the blocks; once resumed, the decode worker finds the KV gone (UNAVAILABLE) and
    frees its own."""
    prefill, decode, *_ = direct
    prompt = real_text_ids[1200:1280]
    handle = _prefill(prefill, "hung", prompt).kv_handle
    errors = []
    pull = threading.Thread(
        target=lambda: errors.append(
            pytest.raises(grpc.RpcError, _decode, decode, "hung", prompt, handle).value.code()
        )
    )
    pull.start()
    time.sleep(1.0)  # the pull is stalled at the prefill worker
    decode.process.send_signal(signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        _wait(lambda: _pinned(prefill) == 0, LEASE_S + 3, "pinned blocks back to 0")
        assert time.monotonic() - stopped <= LEASE_S + 1.0
    finally:
        decode.process.send_signal(signal.SIGCONT)
    pull.join(timeout=30)
    assert errors == [grpc.StatusCode.UNAVAILABLE]
    _wait(lambda: _free(decode, "decode") == 10, 5, "decode blocks back")


def test_decode_killed_mid_transfer_prefill_frees_within_the_lease(direct, real_text_ids):
    prefill, decode, *_ = direct
    prompt = real_text_ids[400:480]
    lapsed = _lease_lapses(prefill)  # earlier tests' (the hung decode worker's)
    handle = _prefill(prefill, "orphan", prompt).kv_handle
    assert _pinned(prefill) == len(handle.block_ids)
    pull = threading.Thread(
        target=lambda: pytest.raises(grpc.RpcError, _decode, decode, "orphan", prompt, handle),
        daemon=True,
    )
    pull.start()
    time.sleep(1.0)  # the pull is stalled at the prefill worker
    decode.process.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    _wait(lambda: _pinned(prefill) == 0, LEASE_S + 3, "pinned blocks back to 0")
    assert time.monotonic() - killed <= LEASE_S + 1.0  # the lease runs from the broken pull
    assert _lease_lapses(prefill) == lapsed + 1
    assert (
        worker_info(prefill.ready["grpc"], "prefill").num_free_blocks
        == worker_info(prefill.ready["grpc"], "prefill").num_blocks
    )


@pytest.mark.parametrize(
    "which, field",
    [
        (2, r"block_size: 16 at the source \(prefill\), 32 at the destination \(decode\)"),
        (3, r"dtype: float32 at the source \(prefill\), bfloat16 at the destination \(decode\)"),
    ],
)
def test_a_layout_mismatch_is_refused_on_both_sides(direct, real_text_ids, which, field):
    prefill, mismatched = direct[0], direct[which]
    refused = _metric(
        prefill, "pdserve_kv_transfer_failures_total", role="prefill", reason="handshake"
    )
    prompt = real_text_ids[600:650]
    handle = _prefill(prefill, f"mismatch-{which}", prompt).kv_handle
    with pytest.raises(grpc.RpcError) as err:
        _decode(mismatched, f"mismatch-{which}", prompt, handle)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert re.search(field, err.value.details()), err.value.details()
    assert (
        _metric(prefill, "pdserve_kv_transfer_failures_total", role="prefill", reason="handshake")
        == refused + 1
    )
    assert (
        _metric(mismatched, "pdserve_kv_transfer_failures_total", role="decode", reason="handshake")
        == 1
    )
    _wait(
        lambda: _pinned(prefill) == 0, 1.5, "the refused request's pin released (before its lease)"
    )
    info = worker_info(mismatched.ready["grpc"], "decode")
    assert info.num_free_blocks == info.num_blocks


# -- a router over prefill workers that stall, and SIGKILL mid-transfer ------------------------


@pytest.fixture
def stalled_cluster(request, default_model):
    """Prefill workers (the first stalls every pull 30 s), one decode worker, a round-robin router:
    the first request goes to the stalled worker. `request.param`: (number of prefill workers,
    decode --kv-transfer-timeout[, --kv-transfer-backend of every worker])."""
    num_prefill, kv_timeout, *backend = request.param
    flags = ["--kv-transfer-backend", backend[0]] if backend else []
    *prefill, decode = start_all(
        ["prefill", "--debug-kv-stall-seconds", "30", *flags],
        *[["prefill", *flags]] * (num_prefill - 1),
        ["decode", "--kv-transfer-timeout", str(kv_timeout), *flags],
    )
    router = start(
        "router",
        "--disaggregation",
        "always",
        "--port",
        "0",
        "--routing",
        "round_robin",
        "--migration-wait",  # with no other prefill worker, a lost KV waits this long for one
        "3",
        "--decode",
        decode.ready["grpc"],
        *[arg for p in prefill for arg in ("--prefill", p.ready["grpc"])],
    )
    yield prefill, decode, router
    _stop(router, decode, *prefill)


def _kill_when_pulling(decode, victim) -> None:
    _wait(
        lambda: worker_info(decode.ready["grpc"], "decode").num_waiting == 1,
        30,
        "a transfer in flight",
    )
    victim.process.send_signal(signal.SIGKILL)


@pytest.mark.parametrize("stalled_cluster", [(2, 20)], indirect=True)
def test_prefill_killed_mid_transfer_is_retried_on_the_other_worker(
    stalled_cluster, real_text_ids, default_model
):
    (stalled, healthy), decode, router = stalled_cluster
    free_before = _free(decode, "decode")
    prompt = real_text_ids[1000:1090]
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(_generate, router, prompt, 10, 60)
        _kill_when_pulling(decode, stalled)
        started = time.monotonic()
        tokens = answer.result(timeout=60)
    assert time.monotonic() - started < 15
    assert_equivalent(
        tokens, hf_greedy(default_model, prompt, 10), context="retried on the other prefill worker"
    )
    assert _free(decode, "decode") == free_before
    _wait(lambda: _pinned(healthy) == 0, 5, "the retried request's pin released")


@pytest.mark.parametrize(
    "stalled_cluster", [(1, 4, "auto"), (1, 4, "torch_dist")], indirect=True, ids=str
)
def test_one_prefill_worker_stall_and_kill_give_clear_errors_in_time(
    stalled_cluster, real_text_ids, request
):
    """Over each one-node data path ("auto" takes shared memory here): the stall ends in time,
    the SIGKILLed source in UNAVAILABLE, with no block left reserved and no segment left."""
    ((prefill,), decode, router) = stalled_cluster
    free_before, segments = _free(decode, "decode"), count_segments()
    # A stalled transfer ends with DEADLINE_EXCEEDED after the decode worker's 4 s, not a hang.
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        _generate(router, real_text_ids[2000:2100], 8, 60)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
    assert "did not arrive within 4 s" in err.value.details()
    assert time.monotonic() - started < 15
    _wait(
        lambda: _pinned(prefill) == 0 and _free(decode, "decode") == free_before, 5, "blocks back"
    )
    # The only prefill worker dies mid-transfer: UNAVAILABLE well within the 60 s deadline.
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(_generate, router, real_text_ids[3000:3100], 8, 60)
        _kill_when_pulling(decode, prefill)
        killed = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            answer.result(timeout=60)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert time.monotonic() - killed < 10
    _wait(
        lambda: _free(decode, "decode") == free_before, 5, "decode blocks back to their start value"
    )
    shared = "auto" in request.node.callspec.id
    # The dead worker's segment is swept by the decode worker that found it dead.
    _wait(lambda: count_segments() == segments - shared, 5, "the killed worker's segment removed")


# -- 100 random cancels -------------------------------------------------------------------------


def test_random_cancels_leave_no_pinned_or_leaked_blocks(default_model, real_text_ids):
    """100 requests cancelled at random points between the start of their prefill and their
    decode admission (each transfer held 0.3 s). With a 60 s lease, every block must be back
    within seconds: through the release paths, not the lease."""
    prefill, decode = start_all(
        ["prefill", "--debug-kv-stall-seconds", "0.3", "--kv-lease-seconds", "60"], ["decode"]
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
    try:
        rng = random.Random(7)
        # How long a request takes to reach decode admission: its span for the cancel points.
        started = time.monotonic()
        _generate(router, real_text_ids[:200], 2)
        span = time.monotonic() - started
        stub = generation_stub(router.ready["grpc"])
        outcomes = []

        def cancelled_request(i: int) -> None:
            start = rng.randrange(0, len(real_text_ids) - 300)
            prompt = real_text_ids[start : start + rng.randrange(20, 260)]
            call = stub.Generate(
                generate_pb2.GenerateRequest(
                    token_ids=generate_pb2.TokenIds(ids=prompt),
                    sampling=common_pb2.SamplingParams(
                        max_tokens=4, temperature=0.0, ignore_eos=True
                    ),
                ),
                timeout=60,
            )
            timer = threading.Timer(rng.uniform(0, span), call.cancel)
            timer.start()
            try:
                for _ in call:
                    pass
                outcomes.append("finished")
            except grpc.RpcError as exc:
                outcomes.append(exc.code().name)
            timer.cancel()

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(cancelled_request, range(100)))
        assert len(outcomes) == 100 and outcomes.count("CANCELLED") >= 90, outcomes
        for proc, role in ((prefill, "prefill"), (decode, "decode")):
            _wait(
                lambda proc=proc, role=role: (
                    lambda i: (
                        i.num_free_blocks == i.num_blocks
                        and i.num_pinned_blocks == 0
                        and i.num_running == 0
                        and i.num_waiting == 0
                    )
                )(worker_info(proc.ready["grpc"], role)),
                10,
                f"{role}: every block back",
            )
        assert (
            _metric(
                prefill,
                "pdserve_kv_transfer_failures_total",
                role="prefill",
                reason="lease_expired",
            )
            == 0
        )
        # Still serving, and right.
        assert_equivalent(
            _generate(router, real_text_ids[:200], 8),
            hf_greedy(default_model, real_text_ids[:200], 8),
        )
    finally:
        _stop(router, prefill, decode)
