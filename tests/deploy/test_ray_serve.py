"""pdserve deployed on a real local Ray cluster from a Serve config file.

One head node (2 CPUs, no GPU, 127.0.0.1), `serve deploy` of tests/deploy/ray_serve_test.yaml:
a router, 2 prefill replicas, 1 decode replica and the registry, a real Redis as the prefix
index. The tests run in file order on one deployment: greedy output through the Ray-served gRPC
and HTTP APIs, a repeated prefix on its holder, decode scaled 1 -> 2 under a bounded stream,
a killed decode replica replaced, pins released, every replica's /metrics in the targets file.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import yaml

from services.common.pb import common_pb2, generate_pb2, worker_pb2_grpc
from tests.e2e.cluster import free_port, generation_stub, scrape
from tests.reference import assert_equivalent, hf_greedy

pytest.importorskip("ray.serve", reason="the Ray deployment needs pdserve[ray]")

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TEST_YAML = Path(__file__).with_name("ray_serve_test.yaml")
MAX_TOKENS = 16


def _sampling(max_tokens: int = MAX_TOKENS) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _generate(stub, prompt: list[int], max_tokens: int = MAX_TOKENS) -> tuple[list[int], int]:
    """(token ids, cached_tokens) of one greedy gRPC request."""
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt), sampling=_sampling(max_tokens)
    )
    tokens, cached = [], -1
    for msg in stub.Generate(request, timeout=60):
        tokens += list(msg.token_ids)
        if msg.finish_reason:
            cached = msg.usage.cached_tokens
    return tokens, cached


class Deployment:
    """The deployed application: its config, the router's addresses, its workers."""

    def __init__(self, ray, config: dict, folder: Path, router: str, http: str) -> None:
        self.ray, self.config, self.folder = ray, config, folder
        self.router, self.http = router, http
        self.stub = generation_stub(router)
        self.admin = worker_pb2_grpc.AdminStub(grpc.insecure_channel(router))

    def workers(self, role: str | None = None):
        listed = self.admin.ListWorkers(common_pb2.InfoRequest(), timeout=10).workers
        return [w for w in listed if role is None or w.role == role]

    def wait_for(self, prefill: int, decode: int, timeout: float = 150.0, exclude=()) -> None:
        """Until the router routes to exactly this many healthy workers of each role."""
        deadline = time.monotonic() + timeout
        seen = None
        while time.monotonic() < deadline:
            try:
                seen = [(w.role, w.address, w.healthy) for w in self.workers()]
            except grpc.RpcError as exc:  # the router replica is still starting
                seen = exc.code()
            else:
                live = [(r, a) for r, a, ok in seen if ok and a not in exclude]
                if sorted(r for r, _ in live) == ["decode"] * decode + ["prefill"] * prefill:
                    if len(seen) == prefill + decode:
                        return
            time.sleep(0.5)
        raise AssertionError(f"workers not {prefill} prefill + {decode} decode: {seen}")

    def redeploy(self, decode_replicas: int) -> None:
        """`serve deploy` again with another decode replica count (Serve's `deployments:`
        override: a lightweight update, no other replica restarts)."""
        app = self.config["applications"][0]
        (decode,) = [d for d in app["deployments"] if d["name"] == "decode"]
        decode["num_replicas"] = decode_replicas
        self.ray.deploy(self.config, self.folder / "serve.yaml")


@pytest.fixture(scope="module")
def deployment(default_model, redis_server, tmp_path_factory):
    from tests.deploy.ray_cluster import RayCluster

    folder = tmp_path_factory.mktemp("ray-serve")
    config = yaml.safe_load(TEST_YAML.read_text())
    args = config["applications"][0]["args"]
    router_port, http_port = free_port(), free_port()
    args["engine"]["model"] = default_model
    args["index"]["redis_url"] = redis_server.url
    args["router_config"]["router"].update(port=router_port, http_port=http_port)
    args["prometheus_targets"] = str(folder / "targets.json")
    ray = RayCluster(num_cpus=2)
    try:
        ray.start()
        ray.deploy(config, folder / "serve.yaml")
        deployed = Deployment(
            ray, config, folder, f"127.0.0.1:{router_port}", f"http://127.0.0.1:{http_port}/v1"
        )
        deployed.wait_for(prefill=2, decode=1)
        yield deployed
    finally:
        ray.stop()


def test_greedy_through_ray_grpc_and_http_matches_transformers(
    deployment, default_model, real_text_ids
):
    from openai import OpenAI
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    client = OpenAI(base_url=deployment.http, api_key="unused", max_retries=0)
    (model,) = [m.id for m in client.models.list().data]
    for length in (5, 33):
        prompt = real_text_ids[3000 + length : 3000 + 2 * length]
        reference = hf_greedy(default_model, prompt, MAX_TOKENS)
        tokens, _ = _generate(deployment.stub, prompt)
        verdict = assert_equivalent(tokens, reference, f"ray grpc len={length}")
        completion = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        # The HTTP API returns text: the same tokens as gRPC's, hence the reference's.
        text = completion.choices[0].text
        assert text == tokenizer.decode(tokens), (text, tokens)
        if tokens == reference.token_ids:
            assert text == tokenizer.decode(reference.token_ids)
        assert completion.usage.completion_tokens == MAX_TOKENS, verdict


def test_repeated_prefix_is_routed_to_the_replica_holding_it(deployment, real_text_ids):
    prefix = real_text_ids[5000:5160]  # 10 blocks of 16
    hits = {w.address: w.info.prefix_cache_hits for w in deployment.workers("prefill")}
    _, first_cached = _generate(deployment.stub, prefix + [11, 12, 13], max_tokens=2)
    time.sleep(0.5)  # the holder's cache events reach Redis
    for i in range(3):
        _, cached = _generate(deployment.stub, prefix + [21 + i, 22, 23], max_tokens=2)
        assert cached >= 160, f"repeat {i} missed the cached prefix ({cached} tokens cached)"
    gained = {
        w.address: w.info.prefix_cache_hits - hits[w.address] for w in deployment.workers("prefill")
    }
    holders = [a for a, n in gained.items() if n > 0]
    assert first_cached == 0 and len(holders) == 1, gained  # every repeat went to one holder
    assert gained[holders[0]] >= 3 * 160, gained


def test_scaling_decode_from_one_to_two_under_load_loses_no_request(
    deployment, default_model, real_text_ids
):
    prompts = [real_text_ids[7000 + 40 * i : 7000 + 40 * i + 24] for i in range(3)]
    references = [hf_greedy(default_model, p, MAX_TOKENS) for p in prompts]
    (old,) = [w.address for w in deployment.workers("decode")]
    results: list[tuple[int, list[int]]] = []
    scaled_at: list[int] = []

    def stream(worker: int) -> None:
        # Bounded: stops 8 requests after the second decode replica joined, or at 80 in all.
        # Two clients, a pause between requests: load, but CPU left for the new replica's start.
        i = worker
        while len(results) < 80 and not (scaled_at and len(results) >= scaled_at[0] + 8):
            tokens, _ = _generate(deployment.stub, prompts[i % 3])
            results.append((i % 3, tokens))
            i += 2
            time.sleep(0.3)

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(stream, w) for w in range(2)]
        deployment.redeploy(decode_replicas=2)
        deployment.wait_for(prefill=2, decode=2)
        scaled_at.append(len(results))
        for future in futures:
            future.result()  # a lost or failed request raises here
    assert scaled_at[0] >= 1 and len(results) >= scaled_at[0] + 8, (scaled_at, len(results))
    for index, tokens in results:
        assert_equivalent(tokens, references[index], f"during scaling, prompt {index}")
    (new,) = [w.address for w in deployment.workers("decode") if w.address != old]
    served = [_generate(deployment.stub, prompts[0])[0] for _ in range(6)]
    for tokens in served:
        assert_equivalent(tokens, references[0], "after scaling")
    new_info = [w.info for w in deployment.workers("decode") if w.address == new]
    assert new_info[0].num_prompt_tokens_computed >= 0  # answers GetInfo
    assert _generation_tokens(new_info[0], new) > 0, "the new replica got no stream"


def _generation_tokens(info, address: str) -> float:
    """Tokens the decode worker at `address` generated, from its /metrics (its config names
    the port it bound)."""
    metrics_port = json.loads(info.config_json)["metrics_port"]
    url = f"http://{address.rpartition(':')[0]}:{metrics_port}/metrics"
    return scrape(url, "pdserve_generation_tokens_total", "decode")


def test_killed_decode_replica_is_replaced_and_no_block_stays_pinned(
    deployment, default_model, real_text_ids
):
    if len(deployment.workers("decode")) < 2:
        deployment.redeploy(decode_replicas=2)
        deployment.wait_for(prefill=2, decode=2)
    actors = deployment.ray.actors("ServeReplica:pdserve:decode")
    assert len(actors) == 2, actors
    before = {w.address for w in deployment.workers("decode")}
    prompt = real_text_ids[9000:9300]
    # Streams in flight while the replica dies: those on it may fail (no migration yet).
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_generate, deployment.stub, prompt, 64) for _ in range(4)]
        time.sleep(0.5)
        os.kill(actors[0]["pid"], signal.SIGKILL)
        outcomes = []
        for future in futures:
            try:
                outcomes.append(future.result())
            except grpc.RpcError as exc:
                outcomes.append(exc.code())
    # Ray replaces the replica; the dead one lapses from the router's pool (registration_ttl).
    deployment.wait_for(prefill=2, decode=2, timeout=120)
    after = {w.address for w in deployment.workers("decode")}
    assert len(after - before) == 1, (before, after)
    reference = hf_greedy(default_model, prompt[:40], MAX_TOKENS)
    for _ in range(4):
        assert_equivalent(_generate(deployment.stub, prompt[:40])[0], reference, "after a kill")
    # Pins of the streams that died with the replica lapse with their lease at the latest.
    lease = yaml.safe_load(TEST_YAML.read_text())["applications"][0]["args"]["engine"]
    deadline = time.monotonic() + lease["kv_lease_seconds"] + 2.0
    while True:
        pinned = {w.address: w.info.num_pinned_blocks for w in deployment.workers("prefill")}
        if set(pinned.values()) == {0} or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert set(pinned.values()) == {0}, pinned
    assert len(outcomes) == 4


def test_every_replica_is_a_prometheus_target(deployment):
    deadline = time.monotonic() + 10
    path = Path(
        yaml.safe_load((deployment.folder / "serve.yaml").read_text())["applications"][0]["args"][
            "prometheus_targets"
        ]
    )
    workers = {w.address for w in deployment.workers()}
    while time.monotonic() < deadline:
        groups = json.loads(path.read_text()) if path.exists() else []
        listed = {g["labels"]["worker"] for g in groups}
        if workers | {deployment.router} <= listed and len(groups) == len(workers) + 1:
            break
        time.sleep(0.5)
    assert workers | {deployment.router} <= listed and len(groups) == len(workers) + 1, groups
    for group in groups:
        (target,) = group["targets"]
        url = f"http://{target}{group['labels']['__metrics_path__']}"
        with urllib.request.urlopen(url, timeout=5) as reply:
            assert b"pdserve_" in reply.read()
        assert group["labels"]["service"].split("-")[0] in ("router", "prefill", "decode")
