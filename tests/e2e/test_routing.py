"""KV-aware routing, the Redis prefix index and worker membership, through real processes:
two prefill workers publishing to a real Redis server, one decode worker, one router."""

from __future__ import annotations

import re
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import pytest

from services.common.pb import common_pb2, generate_pb2, worker_pb2, worker_pb2_grpc
from services.engine.block_hash import block_hashes
from services.prefix_index.index import make_prefix_index
from tests.e2e.cluster import generation_stub, start, start_all, worker_info

pytestmark = pytest.mark.e2e

BLOCK = 16


def _start_cluster(redis_url: str):
    # Chunks of 512 tokens: a long prefill spans several steps, so GetInfo sees it running.
    prefill_args = [
        "prefill", "--port", "0", "--redis-url", redis_url, "--index-ttl", "3",
        "--drain-timeout", "20", "--max-num-batched-tokens", "512",
    ]  # fmt: skip
    decode_args = ["decode", "--port", "0", "--drain-timeout", "20", "--redis-url", redis_url]
    *prefill, decode = start_all(prefill_args, prefill_args, decode_args)
    router = start(
        "router",
        "--disaggregation",
        "always",
        "--port",
        "0",
        "--redis-url",
        redis_url,
        "--index-ttl",
        "3",
        # A request finding no prefill worker left waits this long for one (default 30 s).
        "--migration-wait",
        "3",
        *[arg for p in prefill for arg in ("--prefill", p.ready["grpc"])],
        "--decode",
        decode.ready["grpc"],
    )
    return SimpleNamespace(
        prefill=prefill, decode=decode, router=router, stub=generation_stub(router.ready["grpc"])
    )


def _stop(cluster) -> None:
    for proc in (cluster.router, cluster.decode, *cluster.prefill):
        proc.stop(signal.SIGKILL if proc.process.poll() is None else signal.SIGTERM)


def _generate(stub, prompt: list[int], max_tokens: int = 2) -> tuple[list[int], int, str]:
    """(token ids, cached_tokens, finish_reason) of one greedy request."""
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    tokens, cached, finish = [], -1, ""
    for msg in stub.Generate(request, timeout=120):
        tokens += list(msg.token_ids)
        if msg.finish_reason:
            cached, finish = msg.usage.cached_tokens, msg.finish_reason
    return tokens, cached, finish


def _computed(cluster) -> list[int]:
    """Prompt tokens each prefill worker has run through its model so far."""
    return [
        worker_info(p.ready["grpc"], "prefill").num_prompt_tokens_computed for p in cluster.prefill
    ]


def _wait(predicate, timeout: float) -> float:
    """Seconds until `predicate()` held (AssertionError after `timeout`)."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, "condition not met in time"
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.fixture(scope="module")
def cluster(redis_server):
    cluster = _start_cluster(redis_server.url)
    yield cluster
    _stop(cluster)


def test_shared_prefixes_go_to_the_worker_that_holds_them(cluster, redis_server, real_text_ids):
    prefixes = [real_text_ids[1000 * i : 1000 * i + 320] for i in range(4)]  # 20 blocks each
    owner = {}
    for i, prefix in enumerate(prefixes):  # cold: the router spreads them by load
        before = _computed(cluster)
        _, cached, _ = _generate(cluster.stub, prefix + [100 + i])
        after = _computed(cluster)
        assert cached == 0
        owner[i] = next(w for w in range(2) if after[w] > before[w])
    assert set(owner.values()) == {0, 1}  # both workers got some
    time.sleep(0.5)  # the workers' events reach Redis
    for round_ in range(2):
        for i, prefix in enumerate(prefixes):
            before = _computed(cluster)
            _, cached, _ = _generate(cluster.stub, prefix + [200 + 10 * round_ + i, 7])
            after = _computed(cluster)
            assert cached == 20 * BLOCK, (i, round_)
            assert (
                after[owner[i]] - before[owner[i]] == 2
                and after[1 - owner[i]] == before[1 - owner[i]]
            )

    # The decode worker publishes what it holds too (the serving-path choice reads it), and
    # prefill routing never counted it: every prompt above went to a prefill worker.
    info = worker_info(cluster.decode.ready["grpc"], "decode")
    index = make_prefix_index(redis_server.url, info.model_id, BLOCK, 3.0)
    held = index.match(block_hashes(prefixes[1], BLOCK, info.model_id))
    index.close()
    assert held.get(cluster.decode.ready["grpc"]) == 20, held

    # The owner of prefix 0 forgets it: routing follows the change.
    channel = grpc.insecure_channel(cluster.prefill[owner[0]].ready["grpc"])
    worker_pb2_grpc.AdminStub(channel).ResetPrefixCache(
        worker_pb2.ResetPrefixCacheRequest(), timeout=30
    )
    channel.close()
    time.sleep(0.5)
    _, cached, _ = _generate(cluster.stub, prefixes[0] + [300])
    assert cached == 0
    time.sleep(0.5)
    _, cached, _ = _generate(cluster.stub, prefixes[0] + [301])
    assert cached == 20 * BLOCK  # wherever it went, it is found there now


def test_redis_killed_and_restarted_mid_run_loses_no_request(cluster, redis_server, real_text_ids):
    if not redis_server.owned:
        pytest.skip("needs a redis-server binary to stop and restart")
    prefix = real_text_ids[6000:6320]
    results = []

    def run(n: int) -> None:
        for _ in range(n):
            results.append(_generate(cluster.stub, prefix + [400 + len(results)]))

    run(3)
    redis_server.stop()
    try:
        run(6)  # routing by load alone
    finally:
        redis_server.start()
    # The workers resync within a heartbeat (1 s); then the prefix is found again.
    time.sleep(2.5)
    run(3)
    assert all(finish == "length" and len(tokens) == 2 for tokens, _, finish in results)
    assert results[-1][1] == 20 * BLOCK


def _healthy(router, address: str) -> float:
    text = urllib.request.urlopen(router.ready["metrics"], timeout=5).read().decode()
    match = re.search(
        rf'pdserve_worker_healthy{{role="router",worker="{re.escape(address)}"}} (\S+)', text
    )
    return float(match.group(1)) if match else -1.0


def test_sigkill_stops_routing_within_5s_and_sigterm_drains(cluster, real_text_ids):
    """Last in this file: every worker of the module's cluster goes away here."""
    # SIGKILL one prefill worker: the router stops routing to it within 5 s.
    victim, survivor = cluster.prefill
    assert _healthy(cluster.router, victim.ready["grpc"]) == 1.0
    victim.process.kill()
    assert _wait(lambda: _healthy(cluster.router, victim.ready["grpc"]) == 0.0, 5) < 5
    assert _generate(cluster.stub, real_text_ids[:40])[2] == "length"  # served by the survivor
    # SIGTERM the survivor during a long prefill, then the decode worker during that
    # request's decode: both finish what they had (the answer is whole) and exit 0.
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(_generate, cluster.stub, real_text_ids[100:1600], 60)
        _wait(lambda: worker_info(survivor.ready["grpc"], "prefill").num_running == 1, 60)
        survivor.process.send_signal(signal.SIGTERM)
        _wait(lambda: worker_info(cluster.decode.ready["grpc"], "decode").num_running == 1, 60)
        cluster.decode.process.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as refused:  # no prefill worker takes new work now
            _generate(cluster.stub, real_text_ids[:40])
        tokens, _, finish = stream.result(timeout=120)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
    assert (len(tokens), finish) == (60, "length")
    assert survivor.process.wait(timeout=60) == 0 and cluster.decode.process.wait(timeout=60) == 0
