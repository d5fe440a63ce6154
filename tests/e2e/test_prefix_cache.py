"""Prefix caching through real processes: usage.cached_tokens, the decode worker's own cache,
cache salts, the reset command, and exact prefix-cache and transfer metric deltas."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from services.common.pb import common_pb2, generate_pb2
from tests.e2e.cluster import generation_stub, scrape, start, start_all, worker_info
from tests.reference import assert_equivalent, hf_greedy

pytestmark = pytest.mark.e2e

BLOCK = 16
METRICS = (
    "pdserve_prefix_cache_queries_total",
    "pdserve_prefix_cache_hits_total",
    "pdserve_kv_transfer_bytes_total",
)


@pytest.fixture(scope="module")
def cluster():
    prefill, decode = start_all(["prefill", "--port", "0"], ["decode", "--port", "0"])
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


def _generate(
    stub, prompt: list[int], max_tokens: int, cache_salt: str = ""
) -> tuple[list[int], int]:
    """(token ids, usage.cached_tokens) of one greedy request."""
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        cache_salt=cache_salt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    token_ids, cached = [], None
    for msg in stub.Generate(request, timeout=120):
        token_ids += list(msg.token_ids)
        if msg.finish_reason:
            cached = msg.usage.cached_tokens
    return token_ids, cached


def _metrics(cluster) -> dict[tuple[str, str], float]:
    """Every worker's prefix-cache and transfer counters (after a GetInfo on each: the engine
    loop publishes its counters before it serves the next call)."""
    values = {}
    for role in ("prefill", "decode"):
        proc = getattr(cluster, role)
        worker_info(proc.ready["grpc"], role)
        for name in METRICS:
            values[(role, name)] = scrape(proc.ready["metrics"], name, role)
    return values


def test_cached_tokens_follow_up_turn_salt_reset_and_exact_metrics(
    cluster, default_model, real_text_ids
):
    before = _metrics(cluster)
    info = worker_info(cluster.decode.ready["grpc"], "decode")
    layout = info.kv_layout
    bytes_per_block = (
        2 * layout.num_layers * layout.block_size * layout.num_kv_heads * layout.head_dim * 4
    )
    prompt = real_text_ids[500:570]  # 70 tokens: 4 full blocks + 6

    # 1. Cold. The decode worker computes 30 tokens: KV for 99 positions, 6 full blocks.
    first, cached = _generate(cluster.stub, prompt, 30)
    assert cached == 0
    assert_equivalent(first, hf_greedy(default_model, prompt, 30), "cold")
    # 2. The same prompt: the prefill worker reuses (70 - 1) // 16 = 4 blocks.
    second, cached = _generate(cluster.stub, prompt, 30)
    assert (second, cached) == (first, 4 * BLOCK)
    # 3. A follow-up turn: prompt + answer + 20 new tokens (120). The prefill worker holds the
    # first prompt's 4 blocks; the decode worker holds 6 (it computed the answer's KV itself).
    follow_up = prompt + first + real_text_ids[2000:2020]
    third, cached = _generate(cluster.stub, follow_up, 8)
    assert cached == 4 * BLOCK
    assert_equivalent(third, hf_greedy(default_model, follow_up, 8), "follow-up")
    # 4. Another salt shares nothing, on either worker.
    salted, cached = _generate(cluster.stub, prompt, 30, cache_salt="tenant-b")
    assert (salted, cached) == (first, 0)
    # 5. `pdserve reset-prefix-cache` on the router empties both workers' caches.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli.main",
            "reset-prefix-cache",
            "--url",
            cluster.router.ready["grpc"],
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply["num_workers"] == 2 and reply["num_hashes_dropped"] > 0
    assert all(
        worker_info(getattr(cluster, r).ready["grpc"], r).num_cached_blocks == 0
        for r in ("prefill", "decode")
    )
    after_reset, cached = _generate(cluster.stub, prompt, 30)
    assert (after_reset, cached) == (first, 0)

    after = _metrics(cluster)
    delta = {key: after[key] - before[key] for key in after}
    prompts = [70, 70, 120, 70, 70]
    assert delta[("prefill", "pdserve_prefix_cache_queries_total")] == sum(prompts)
    assert delta[("prefill", "pdserve_prefix_cache_hits_total")] == 4 * BLOCK + 4 * BLOCK
    assert delta[("decode", "pdserve_prefix_cache_queries_total")] == sum(prompts)
    # Decode hits: all 4 full prompt blocks on the repeat, 6 blocks of the follow-up.
    assert delta[("decode", "pdserve_prefix_cache_hits_total")] == 4 * BLOCK + 6 * BLOCK
    # Pulled: 5 + 1 + (8 - 6) + 5 + 5 blocks (and the prefill worker sent exactly those).
    pulled = (5 + 1 + 2 + 5 + 5) * bytes_per_block
    assert delta[("decode", "pdserve_kv_transfer_bytes_total")] == pulled
    assert delta[("prefill", "pdserve_kv_transfer_bytes_total")] == pulled


# Every offset in a block with 0, 1 and 2 blocks cached, and the block edges above.
REFERENCE_LENGTHS = {*range(1, 34), 47, 48, 49, 63, 64, 65, 79, 80}


def test_usage_cached_tokens_rule_for_every_prompt_length_1_to_80(
    cluster, default_model, real_text_ids
):
    """Through the public API: each length sent twice; the second send reports
    (n - 1) // 16 * 16 cached tokens (the first none) and the same token, which meets the
    equivalence rule against transformers (at REFERENCE_LENGTHS)."""

    def sends(n: int) -> tuple[int, list[int], list[int], list[int], int, int]:
        prompt = real_text_ids[9000 + 100 * n : 9000 + 100 * n + n]  # disjoint texts per length
        cold, cold_cached = _generate(cluster.stub, prompt, 1)
        warm, warm_cached = _generate(cluster.stub, prompt, 1)
        return n, prompt, cold, warm, cold_cached, warm_cached

    # Four lengths at a time (their texts share no block, so no send changes another's count).
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(sends, range(1, 81)))
    for n, prompt, cold, warm, cold_cached, warm_cached in results:
        assert (cold_cached, warm_cached) == (0, (n - 1) // BLOCK * BLOCK), n
        assert warm == cold, n  # a hit changes no token
        if n in REFERENCE_LENGTHS:
            assert_equivalent(cold, hf_greedy(default_model, prompt, 1), f"cold n={n}")
