"""Observability of a real cluster: a real Prometheus (Debian's binary, the shipped
deploy/prometheus/ config) scrapes a `pdserve serve --prometheus-targets` cluster while it serves
a known mix of requests, every failure kind included; then every counter is exact, the TTFT
histogram agrees with the client's clock, every dashboard query and every alert query returns
data, and the recompute alert is silent. A second cluster whose decode worker recomputes the
prompt instead of pulling its KV fires that alert, and its logs carry the client's request id."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import grpc
import openai
import pytest

from deploy.grafana import panels
from services.common.pb import common_pb2, generate_pb2
from tests.deploy.test_prometheus_grafana import alert_query, alert_rules
from tests.e2e.cluster import generation_stub, scrape, start
from tests.prometheus_server import PrometheusServer
from tests.reference import assert_equivalent, hf_greedy

pytestmark = pytest.mark.e2e

KEY = "sk-observability"
AUTH = (("authorization", f"Bearer {KEY}"),)


def substitute(expr: str) -> str:
    """As Grafana would with "All" selected and the SLOs at their defaults; $__rate_interval is
    at least 4 scrape intervals: 2m keeps the whole mix in the window."""
    expr = panels.substitute(expr, "2m")
    assert "$" not in expr, expr
    return expr


@dataclass
class Mix:
    """What the client saw: per sequence that got a first token, its prompt tokens, the tokens it
    received and its TTFT (client clock); the successes' finish reasons; errors by code."""

    prompt_tokens: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    # Scrapes, rule evaluations and target discovery every second (shipped: 5 s): the waits for
    # a scrape and for the alert are rounds of this interval.
    server = PrometheusServer(tmp_path_factory.mktemp("observability"), interval="1s")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cluster(prometheus, tmp_path_factory):
    """One decode slot and a queue of one (so overload is deterministic), short prompts on the
    local path, JSON logs in a file."""
    log = (tmp_path_factory.mktemp("logs") / "serve.log").open("w")
    os.environ["PDSERVE_API_KEY"] = KEY
    try:
        proc = start(
            "serve", "--port", "0", "--http-port", "0",
            "--max-num-seqs", "1", "--max-queued-requests", "1",
            "--disaggregation", "auto", "--max-local-prefill-tokens", "8",
            "--prometheus-targets", str(prometheus.targets_dir / "main.json"),
            "--log-format", "json",
            stderr=log,
        )  # fmt: skip
    finally:
        del os.environ["PDSERVE_API_KEY"]
    yield proc
    assert proc.stop() == 0
    log.close()


def _router_metric(cluster, name: str, **labels: str) -> float:
    router = next(s for s in cluster.ready["services"] if s["role"] == "router")
    return scrape(router["metrics"], name, "router", **labels)


def _stream_grpc(
    cluster, prompt: list[int], max_tokens: int, mix: Mix, request_id: str = "", **call
) -> grpc.Call:
    """Start a streamed gRPC request; a thread reads it into `mix` (returns the call)."""
    stub = generation_stub(cluster.ready["router"])
    request = generate_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )
    sent = time.monotonic()
    stream = stub.Generate(request, metadata=AUTH, **call)
    first = threading.Event()

    def read() -> None:
        received = 0
        try:
            for message in stream:
                if message.token_ids and not received:
                    mix.ttfts.append(time.monotonic() - sent)
                    mix.prompt_tokens.append(len(prompt))
                    first.set()
                received += len(message.token_ids)
                if message.finish_reason:
                    mix.finished.append(message.finish_reason)
        except grpc.RpcError as exc:
            mix.error(exc.code().name)
        finally:
            if received:
                mix.tokens.append(received)
            first.set()

    stream.reader = threading.Thread(target=read)
    stream.first = first
    stream.reader.start()
    return stream


def _stream_http(client: openai.OpenAI, mix: Mix, **body) -> None:
    sent, first, usage, finish = time.monotonic(), None, None, None
    for chunk in client.completions.create(
        stream=True, stream_options={"include_usage": True}, temperature=0, **body
    ):
        if chunk.choices and chunk.choices[0].text and first is None:
            first = time.monotonic() - sent
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        usage = chunk.usage or usage
    assert first is not None and usage is not None and finish is not None
    mix.ttfts.append(first)
    mix.prompt_tokens.append(usage.prompt_tokens)
    mix.tokens.append(usage.completion_tokens)
    mix.finished.append(finish)


def _post(cluster, body: bytes, key: str = KEY) -> int:
    request = urllib.request.Request(
        cluster.ready["http"] + "/v1/completions",
        data=body,
        headers={"content-type": "application/json", "authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def run_mix(cluster, real_text_ids) -> Mix:
    mix = Mix()
    client = openai.OpenAI(base_url=cluster.ready["http"] + "/v1", api_key=KEY, max_retries=0)
    model = client.models.list().data[0].id
    # Successes: a short prompt (local path), longer ones (remote), text and token ids.
    _stream_http(client, mix, model=model, prompt="Hi", max_tokens=6)
    _stream_http(client, mix, model=model, prompt=real_text_ids[:40], max_tokens=12)
    _stream_http(
        client, mix, model=model, prompt="The capital of France is Paris. " * 4, max_tokens=5
    )
    ok = _stream_grpc(cluster, real_text_ids[100:164], 10, mix, "obs-field-1", timeout=60)
    ok.reader.join()
    assert dict(ok.initial_metadata())["x-request-id"] == "obs-field-1"  # the field's id
    # Refused before any work: bad JSON, a wrong type, a range error, another model, a bad key.
    statuses = [
        _post(cluster, b"{not json"),
        _post(cluster, json.dumps({"prompt": "x", "max_tokens": "many"}).encode()),
        _post(cluster, json.dumps({"prompt": "x", "temperature": -1}).encode()),
        _post(cluster, json.dumps({"prompt": "x", "model": "another"}).encode()),
        _post(cluster, json.dumps({"prompt": "x"}).encode(), key="wrong"),
    ]
    assert statuses == [400, 400, 400, 404, 401]
    for code in ("INVALID_ARGUMENT",) * 3 + ("NOT_FOUND", "UNAUTHENTICATED"):
        mix.error(code)
    # Overload: A holds the one decode slot; B (admitted, the queue's one place) gets its first
    # token from the prefill pool and then waits for the slot past its deadline; C meanwhile
    # gets 429; D, admitted after B, is cancelled by its client after its first token.
    long = _stream_grpc(cluster, real_text_ids[200:260], 400, mix, timeout=120)
    assert long.first.wait(60)
    late = _stream_grpc(cluster, real_text_ids[300:340], 50, mix, timeout=2.0)
    assert late.first.wait(10)
    assert _post(cluster, json.dumps({"prompt": real_text_ids[:30]}).encode()) == 429
    mix.error("RESOURCE_EXHAUSTED")
    late.reader.join()
    # The client's deadline passed; the router lets B's queue place go a moment later.
    deadline = time.monotonic() + 10
    while _router_metric(cluster, "pdserve_sequences_in_flight") > 1:
        assert time.monotonic() < deadline, "B's queue place was not released"
        time.sleep(0.05)
    cancelled = _stream_grpc(cluster, real_text_ids[400:440], 50, mix, timeout=60)
    assert cancelled.first.wait(10)
    time.sleep(0.3)
    cancelled.cancel()
    cancelled.reader.join()
    long.reader.join()
    assert mix.errors["DEADLINE_EXCEEDED"] == 1 and mix.errors["CANCELLED"] == 1, mix.errors
    return mix


def test_counters_dashboards_and_alerts_against_a_real_prometheus(
    cluster, prometheus, real_text_ids
):
    # Prometheus found every service of the cluster through the targets file.
    names = {s["name"] for s in cluster.ready["services"]}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        up = {
            t["labels"].get("service") for t in prometheus.active_targets() if t["health"] == "up"
        }
        if names <= up:
            break
        time.sleep(0.5)
    assert names <= up, (names, up)
    mix = run_mix(cluster, real_text_ids)

    # Counters exact (the router's /metrics, read directly).
    assert _router_metric(cluster, "pdserve_prompt_tokens_total") == sum(mix.prompt_tokens)
    assert _router_metric(cluster, "pdserve_generation_tokens_total") == sum(mix.tokens)
    for reason in ("stop", "length"):
        assert _router_metric(
            cluster, "pdserve_request_success_total", finish_reason=reason
        ) == mix.finished.count(reason), mix.finished
    from services.common.metrics import ERROR_CODES

    for code in ERROR_CODES:
        assert _router_metric(cluster, "pdserve_request_errors_total", code=code) == mix.errors.get(
            code, 0
        ), (code, mix.errors)
    assert _router_metric(cluster, "pdserve_requests_total", path="local") == 1
    # The TTFT histogram counts each sequence that got a first token once, and its sum agrees
    # with the client's clock (which also counts the network and the client's parsing).
    count = _router_metric(cluster, "pdserve_time_to_first_token_seconds_count")
    total = _router_metric(cluster, "pdserve_time_to_first_token_seconds_sum")
    assert count == len(mix.ttfts)
    assert total <= sum(mix.ttfts) <= total + 0.05 * count + 0.2 * total, (total, mix.ttfts)
    decode = next(s for s in cluster.ready["services"] if s["role"] == "decode")
    recomputed = "pdserve_decode_recomputed_prompt_tokens_total"
    assert scrape(decode["metrics"], recomputed, "decode", cause="fallback") == 0
    assert scrape(decode["metrics"], recomputed, "decode", cause="local_prefill") == 1

    # Prometheus has scraped the end of the mix.
    deadline = time.monotonic() + 30
    cancelled = 'pdserve_request_errors_total{role="router", code="CANCELLED"}'
    while time.monotonic() < deadline:
        result = prometheus.query(cancelled)
        if result and float(result[0]["value"][1]) == 1:
            break
        time.sleep(1)
    else:
        pytest.fail("Prometheus never scraped the end of the mix")

    # Every dashboard query returns data (Grafana's variables substituted as Grafana would).
    for row in panels.ROWS:
        for panel in row.panels:
            for query in panel.queries:
                result = prometheus.query(substitute(query.expr))
                assert result, f"{row.title} / {panel.title}: no data for {query.expr}"
    for name in ("TTFT", "TPOT", "ITL", "E2E latency", "Mean seconds per leg"):
        [panel] = [p for row in panels.ROWS for p in row.panels if p.title == name]
        values = [float(s["value"][1]) for s in prometheus.query(substitute(panel.queries[0].expr))]
        assert values and all(math.isfinite(v) and v >= 0 for v in values), (name, values)
    # Every alert's query (without its comparison) returns data; the recompute alert is silent.
    for rule in alert_rules():
        assert prometheus.query(alert_query(rule)), f"{rule['alert']}: no data"
    [rule] = [r for r in alert_rules() if r["alert"] == "PdserveDecodeRecomputingPrompts"]
    recompute = alert_query(rule)
    assert all(float(s["value"][1]) == 0 for s in prometheus.query(recompute))
    firing = {a["labels"]["alertname"] for a in prometheus.alerts()}
    assert "PdserveDecodeRecomputingPrompts" not in firing


def test_status_lists_the_routers_workers(cluster):
    argv = [sys.executable, "-m", "services.cli.main", "status", "--url", cluster.ready["router"]]
    listed = json.loads(
        subprocess.run(
            [*argv, "--json", "--api-key", KEY], capture_output=True, text=True, check=True
        ).stdout
    )
    workers = {s["grpc"]: s["role"] for s in cluster.ready["services"] if s["role"] != "router"}
    assert {row["address"]: row["role"] for row in listed} == workers
    for row in listed:
        assert row["healthy"] and row["error"] is None and row["num_blocks"] > 0
        assert row["free_blocks"] + row["pinned_blocks"] <= row["num_blocks"]
        assert 0 <= row["kv_usage"] <= 1 and 0 <= row["prefix_hit_rate"] <= 1
        assert row["running"] == row["waiting"] == 0
    shown = subprocess.run(
        [*argv, "--api-key", KEY],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "200"},
    ).stdout
    for address in workers:
        assert address in shown
    assert "healthy" in shown and "prefix hit rate" in shown
    refused = subprocess.run([*argv, "--api-key", "wrong"], capture_output=True, text=True)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr


def _wait_scraped(prometheus: PrometheusServer, worker: str, timeout: float = 30) -> None:
    expr = f'pdserve_decode_recomputed_prompt_tokens_total{{worker="{worker}", cause="fallback"}}'
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if prometheus.query(expr):
            return
        time.sleep(0.5)
    pytest.fail(f"Prometheus did not scrape {worker} within {timeout} s")


def test_a_decode_worker_that_recomputes_fires_the_alert_and_logs_carry_the_id(
    prometheus, default_model, real_text_ids, tmp_path
):
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = start(
            "serve", "--port", "0", "--http-port", "0", "--disaggregation", "always",
            "--decode-debug-recompute-prompt",
            "--prometheus-targets", str(prometheus.targets_dir / "recompute.json"),
            "--log-format", "json",
            stderr=log,
        )  # fmt: skip
        try:
            decode = next(s for s in proc.ready["services"] if s["role"] == "decode")
            # Prometheus must have seen the counter at 0 first: an increase needs two samples.
            _wait_scraped(prometheus, decode["grpc"])
            prompt = real_text_ids[1000:1100]
            stub = generation_stub(proc.ready["router"])
            stream = stub.Generate(
                generate_pb2.GenerateRequest(
                    token_ids=generate_pb2.TokenIds(ids=prompt),
                    sampling=common_pb2.SamplingParams(max_tokens=12, temperature=0),
                ),
                metadata=(("x-request-id", "obs-recompute-1"),),
                timeout=60,
            )
            tokens = [t for message in stream for t in message.token_ids]
            assert dict(stream.initial_metadata())["x-request-id"] == "obs-recompute-1"
            # Recomputing is slower, never wrong: the output is still the reference's.
            assert_equivalent(tokens, hf_greedy(default_model, prompt, 12), "recomputed")
            recomputed = scrape(
                decode["metrics"],
                "pdserve_decode_recomputed_prompt_tokens_total",
                "decode",
                cause="fallback",
            )
            assert recomputed == len(prompt)  # every prompt position, none pulled
            deadline, fired = time.monotonic() + 60, []
            while time.monotonic() < deadline and not fired:
                fired = [
                    a
                    for a in prometheus.alerts()
                    if a["labels"]["alertname"] == "PdserveDecodeRecomputingPrompts"
                    and a["state"] == "firing"
                ]
                time.sleep(1)
            assert fired and fired[0]["labels"]["worker"] == decode["grpc"], fired
        finally:
            assert proc.stop() == 0
    records = [
        json.loads(line) for line in log_path.read_text().splitlines() if line.startswith('{"')
    ]
    mine = [r for r in records if r.get("request_id") == "obs-recompute-1"]
    assert {r["role"] for r in mine} >= {"router", "decode"}, mine
    assert any("request finished" in r["message"] for r in mine if r["role"] == "router")
    assert any("recomputing the prompt" in r["message"] for r in mine if r["role"] == "decode")
