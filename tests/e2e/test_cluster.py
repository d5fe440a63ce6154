"""Router -> prefill -> KV blocks over gRPC -> decode, as separate processes on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest

from services.cluster.placement import plan_placement
from services.common.pb import common_pb2, generate_pb2
from services.router.flow.request_stats import LEGS
from services.worker.cpus import format_cpus
from tests.e2e.cluster import generate, generation_stub, pid_alive, scrape, start, worker_info
from tests.reference import assert_equivalent, hf_greedy

pytestmark = pytest.mark.e2e

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    proc = start(
        "serve", "--port", "0", "--http-port", "0", "--num-prefill", "1", "--num-decode", "1",
        "--disaggregation", "always",  # every prompt over the KV transfer (the local path: below)
    )  # fmt: skip
    yield proc
    assert proc.stop() == 0
    deadline = time.monotonic() + 10
    while any(pid_alive(pid) for pid in proc.pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in proc.pids if pid_alive(pid)], "serve left processes behind"


def _service(cluster, role: str) -> dict:
    return next(s for s in cluster.ready["services"] if s["role"] == role)


def _free_blocks(cluster) -> tuple[float, float]:
    return tuple(
        scrape(_service(cluster, r)["metrics"], "pdserve_kv_blocks_free", r)
        for r in ("prefill", "decode")
    )


def _sampling(max_tokens: int, **kwargs) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, **{**GREEDY, **kwargs})


def test_ready_line_follows_the_contract(cluster):
    ready = cluster.ready
    assert ready["router"].startswith("127.0.0.1:") and ready["http"].startswith(
        "http://127.0.0.1:"
    )
    roles = [s["role"] for s in ready["services"]]
    assert roles == ["router", "prefill", "decode"]
    for service in ready["services"]:
        assert service["grpc"].startswith("127.0.0.1:") and service["metrics"].endswith("/metrics")
        assert pid_alive(service["pid"])


@pytest.mark.parametrize("length", [1, 16, 17, 33, 100])
def test_greedy_through_the_cluster_matches_transformers(
    cluster, default_model, real_text_ids, length
):
    prompt = real_text_ids[2000 + length : 2000 + 2 * length]
    tokens, _, finish = generate(
        generation_stub(cluster.ready["router"]),
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=_sampling(24),
    )
    assert finish == "length"
    assert_equivalent(tokens, hf_greedy(default_model, prompt, 24), f"len={length}")


def test_eight_concurrent_requests(cluster, default_model, real_text_ids):
    lengths = [3, 9, 16, 17, 30, 47, 64, 90]
    prompts = [real_text_ids[300 * i : 300 * i + n] for i, n in enumerate(lengths)]
    results: dict[int, list[int]] = {}
    stub = generation_stub(cluster.ready["router"])

    def run(i: int) -> None:
        results[i], _, _ = generate(
            stub, token_ids=generate_pb2.TokenIds(ids=prompts[i]), sampling=_sampling(20)
        )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) == len(prompts)
    for i, prompt in enumerate(prompts):
        assert_equivalent(results[i], hf_greedy(default_model, prompt, 20), f"concurrent {i}")


def test_decode_never_runs_the_prompt(cluster):
    info = worker_info(_service(cluster, "decode")["grpc"], "decode")
    assert info.num_prompt_tokens_computed == 0
    assert info.max_step_tokens_per_request == 1


@pytest.mark.parametrize(
    "request_kwargs, field",
    [
        (dict(text=""), "prompt"),
        (dict(token_ids=generate_pb2.TokenIds(ids=[1] * 9000)), "prompt"),
        (dict(text="hi", sampling=common_pb2.SamplingParams(max_tokens=0)), "max_tokens"),
        (dict(text="hi", sampling=common_pb2.SamplingParams(temperature=-1)), "temperature"),
        (dict(text="hi", sampling=common_pb2.SamplingParams(top_p=0)), "top_p"),
        (dict(text="hi", sampling=common_pb2.SamplingParams(top_p=1.5)), "top_p"),
        (dict(text="hi", sampling=common_pb2.SamplingParams(top_k=-2)), "top_k"),
        (dict(token_ids=generate_pb2.TokenIds(ids=[5, 10**6])), "prompt_token_ids"),
    ],
)
def test_bad_input_names_the_field_and_leaves_no_trace(cluster, request_kwargs, field):
    stub = generation_stub(cluster.ready["router"])
    before = _free_blocks(cluster)
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, **request_kwargs)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()
    tokens, _, _ = generate(stub, text="Hello there", sampling=_sampling(3))
    assert len(tokens) == 3
    assert _wait_for(lambda: _free_blocks(cluster) == before)


def test_cancelled_stream_frees_blocks_on_both_workers(cluster, real_text_ids):
    stub = generation_stub(cluster.ready["router"])
    before = _free_blocks(cluster)
    call = stub.Generate(
        generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=real_text_ids[:200]), sampling=_sampling(400)
        ),
        timeout=120,
    )
    next(call), next(call), next(call)
    assert _free_blocks(cluster)[1] < before[1]  # decode holds the request's blocks now
    call.cancel()
    assert _wait_for(lambda: _free_blocks(cluster) == before), (_free_blocks(cluster), before)


def test_generate_cli_answers_paris(cluster):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli.main",
            "generate",
            "--url",
            cluster.ready["router"],
            "--chat",
            "What is the capital of France?",
            "--temperature",
            "0",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "Paris" in result["text"]
    assert set(LEGS) <= set(result["timings"]) and result["timings"]["path"] == "remote"
    assert (
        result["finish_reason"] in ("stop", "length") and result["usage"]["completion_tokens"] >= 1
    )


def test_zeroed_transferred_block_changes_the_output(cluster, real_text_ids):
    """Decode computes from the KV it received: zeroing one received block changes its tokens."""
    prompt = real_text_ids[5000:5064]
    clean, _, _ = generate(
        generation_stub(cluster.ready["router"]),
        token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling=_sampling(16),
    )
    prefill = _service(cluster, "prefill")["grpc"]
    decode = start("decode", "--port", "0", "--metrics-port", "0", "--debug-zero-kv-block", "1")
    router = start(
        "router",
        "--disaggregation",
        "always",
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--prefill",
        prefill,
        "--decode",
        decode.ready["grpc"],
    )
    try:
        broken, _, _ = generate(
            generation_stub(router.ready["grpc"]),
            token_ids=generate_pb2.TokenIds(ids=prompt),
            sampling=_sampling(16),
        )
    finally:
        router.stop()
        decode.stop()
    assert broken != clean


REQUIRED_METRICS = [
    "pdserve_kv_blocks_free",
    "pdserve_kv_blocks_pinned",
    "pdserve_num_requests_running",
    "pdserve_num_requests_waiting",
    "pdserve_time_to_first_token_seconds",
    "pdserve_time_per_output_token_seconds",
]


def test_every_service_exports_metrics(cluster):
    """Each service's /metrics is a real Prometheus text page with the pdserve families."""
    generate(generation_stub(cluster.ready["router"]), text="Hello", sampling=_sampling(4))
    for service in cluster.ready["services"]:
        text = urllib.request.urlopen(service["metrics"], timeout=5).read().decode()
        for name in REQUIRED_METRICS:
            assert f"# TYPE {name} " in text, (service["role"], name)
    router = (
        urllib.request.urlopen(_service(cluster, "router")["metrics"], timeout=5).read().decode()
    )
    count = next(
        line
        for line in router.splitlines()
        if line.startswith('pdserve_time_to_first_token_seconds_count{role="router"}')
    )
    assert float(count.split()[-1]) >= 1
    assert 'pdserve_request_generation_tokens_count{role="router"}' in router
    decode_page = (
        urllib.request.urlopen(_service(cluster, "decode")["metrics"], timeout=5).read().decode()
    )
    assert 'pdserve_kv_cache_bytes{role="decode",state="free"}' in decode_page
    assert (
        scrape(_service(cluster, "decode")["metrics"], "pdserve_kv_transfer_bytes_total", "decode")
        > 0
    )


def test_killed_client_frees_blocks_on_both_workers(cluster, real_text_ids):
    """SIGKILL a `pdserve generate` process mid-stream: both workers get their blocks back."""
    before = _free_blocks(cluster)
    ids = ",".join(map(str, real_text_ids[:150]))
    client = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli.main",
            "generate",
            "--url",
            cluster.ready["router"],
            "--prompt-ids",
            ids,
            "--max-tokens",
            "1000",
            "--ignore-eos",
            "--temperature",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert _wait_for(lambda: _free_blocks(cluster)[1] < before[1], timeout=60)  # decoding now
    client.kill()
    client.wait()
    assert _wait_for(lambda: _free_blocks(cluster) == before), (_free_blocks(cluster), before)


def _wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def _within(legs: float, measured: float) -> bool:
    """The timings rule of issue 15: within 10% or 5 ms."""
    return abs(legs - measured) <= max(0.10 * measured, 0.005)


def test_the_legs_add_up_to_the_client_measured_ttft_and_e2e(cluster, real_text_ids):
    """An undelayed request's legs (router queue, tokenize, prefill queue and compute; decode
    queue, KV transfer, first decode step, decode) add up to the TTFT and E2E its client
    measured, on the gRPC API and on the HTTP final chunk; the leg histograms count them."""
    stub = generation_stub(cluster.ready["router"])
    router_metrics = _service(cluster, "router")["metrics"]
    generate(stub, token_ids=generate_pb2.TokenIds(ids=real_text_ids[:64]), sampling=_sampling(2))
    legs_before = _leg_count(router_metrics, "prefill")
    for offset in (0, 300, 600):
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=real_text_ids[offset : offset + 200]),
            sampling=_sampling(24),
        )
        sent = time.monotonic()
        first = None
        for msg in stub.Generate(request, timeout=120):
            if msg.token_ids and first is None:
                first = time.monotonic() - sent
            final = msg
        e2e = time.monotonic() - sent
        t = final.timings
        assert t.path == "remote" and t.prefill > 0 and t.kv_transfer > 0 and t.decode > 0, t
        assert t.first_decode_step > 0 and min(t.router_queue, t.prefill_queue, t.decode_queue) >= 0
        to_first = t.router_queue + t.tokenize + t.prefill_queue + t.prefill
        to_last = to_first + t.decode_queue + t.kv_transfer + t.first_decode_step + t.decode
        assert _within(to_first, first), (to_first, first, t)
        assert _within(to_last, e2e), (to_last, e2e, t)
    assert _leg_count(router_metrics, "prefill") == legs_before + 3
    http = cluster.ready["http"]
    body = json.dumps(
        {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stream": True}
    ).encode()
    request = urllib.request.Request(
        f"{http}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response if line.startswith(b"data: {")]
    timings = events[-1]["choices"][0]["timings"]
    assert timings["path"] == "remote" and timings["e2e"] >= timings["ttft"] > 0, timings
    assert set(LEGS) <= set(timings)


def _leg_count(url: str, leg: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    prefix = f'pdserve_request_leg_seconds_count{{leg="{leg}",role="router"}} '
    return next(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))


def test_every_child_runs_on_its_planned_cpus_with_threads_to_match(cluster):
    """`pdserve serve`'s default placement, as running: each child's allowed CPUs are its
    plan's, and each worker runs one torch thread per CPU (its GetInfo's effective config)."""
    plan = plan_placement(sorted(os.sched_getaffinity(0)), 1, 1)
    planned = {"router": plan.router, "prefill": plan.prefill[0], "decode": plan.decode[0]}
    for service in cluster.ready["services"]:
        role = service["role"]
        assert sorted(os.sched_getaffinity(service["pid"])) == list(planned[role]), role
        if role != "router":
            config = json.loads(worker_info(service["grpc"], role).config_json)
            assert config["threads"] == len(planned[role]), (role, config)
            assert config["cpus"] == format_cpus(planned[role])


def _final(
    stub, prompt: list[int], max_tokens: int
) -> tuple[list[int], generate_pb2.GenerateResponse]:
    token_ids, final = [], None
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt), sampling=_sampling(max_tokens)
    )
    for msg in stub.Generate(request, timeout=120):
        token_ids += list(msg.token_ids)
        final = msg
    return token_ids, final


def test_short_prompts_prefill_on_the_decode_worker_with_the_remote_paths_output(
    cluster, default_model, real_text_ids
):
    """Conditional disaggregation: a router in `auto` over the same workers prefills a prompt
    of at most --max-local-prefill-tokens on the decode worker (mixed into its steps) and a
    longer one on the prefill pool; each path is counted and shown in the timings; the local
    path's greedy tokens equal the remote path's and transformers'; no block stays behind."""
    auto = start(
        "router", "--port", "0",
        "--prefill", _service(cluster, "prefill")["grpc"],
        "--decode", _service(cluster, "decode")["grpc"],
        "--max-local-prefill-tokens", "48",
    )  # fmt: skip
    try:
        stub, always = generation_stub(auto.ready["grpc"]), generation_stub(cluster.ready["router"])
        before = _free_blocks(cluster)
        short, long = real_text_ids[4000:4048], real_text_ids[4100:4149]
        local_ids, local = _final(stub, short, 16)
        remote_ids, remote = _final(always, short, 16)
        _, long_final = _final(stub, long, 4)
        assert (local.timings.path, remote.timings.path) == ("local", "remote")
        assert long_final.timings.path == "remote"
        assert local.timings.kv_transfer == 0 and local.timings.prefill > 0
        t = local.timings
        legs = t.router_queue + t.tokenize + t.prefill_queue + t.prefill
        assert legs + t.first_decode_step + t.decode == pytest.approx(t.e2e, abs=0.01), t
        reference = hf_greedy(default_model, short, 16)
        assert_equivalent(local_ids, reference, "local path")
        assert_equivalent(remote_ids, reference, "remote path")
        assert local_ids == remote_ids
        metrics = auto.ready["metrics"]
        assert scrape_path(metrics, "local") == 1 and scrape_path(metrics, "remote") == 1
        assert _wait_for(lambda: _free_blocks(cluster) == before), (_free_blocks(cluster), before)
    finally:
        auto.stop()


def scrape_path(url: str, path: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    prefix = f'pdserve_requests_total{{path="{path}",role="router"}} '
    return next(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))


@pytest.mark.parametrize("api", ["http", "grpc"])
def test_bench_serve_drives_the_cluster_and_reports_every_request(cluster, tmp_path, api):
    """`pdserve bench serve` against the real cluster over each API: every request completes
    with its full output and no cached prompt token, each carries pdserve's timings, its
    client-side TTFT is at least the router's, and the JSON and plot are written. The objectives
    travel with each request (`--slo-headers`: x-slo-* headers, gRPC objective fields)."""
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    where = ["--grpc", cluster.ready["router"]]
    if api == "http":
        where = ["--base-url", cluster.ready["http"]]
    subprocess.run(
        [
            sys.executable, "-m", "services.cli.main", "bench", "serve", *where,
            "--num-prompts", "6", "--random-input-len", "40", "--random-output-len", "6",
            "--request-rate", "8,16", "--goodput", "ttft:20000", "tpot:5000", "itl:5000",
            "--slo-headers", "--num-warmups", "2", "--json", str(out), "--plot", str(png),
            "--no-progress",
        ],
        check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    run = json.loads(out.read_text())
    assert [p["request_rate"] for p in run["points"]] == [8, 16]
    assert run["goodput"]["request_rate"] == 16 and run["config"]["machine"]["cpus"] >= 1
    for point in run["points"]:
        assert point["completed"] == 6 and point["attainment"] == 1.0 and not point["errors"]
        for r in point["requests"]:
            assert (r["output_tokens"], r["prompt_len"], r["cached_tokens"]) == (6, 40, 0), r
            assert r["timings"]["path"] == "remote" and r["ttft"] >= r["timings"]["ttft"]
            assert len(r["itl"]) >= 1 and r["e2e"] >= r["ttft"]
    assert png.stat().st_size > 10_000


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


THREADS_ABOVE_IDLE = 8  # after a burst: what each process may keep over its idle count


def test_threads_return_to_idle_after_200_streams(cluster, real_text_ids):
    """200 concurrent streams grow every process's threads (one per stream on the gRPC
    servers); within seconds of their end each process is back within THREADS_ABOVE_IDLE of
    its idle count (the pools let idle threads go)."""
    pids = {s["role"]: s["pid"] for s in cluster.ready["services"]}
    idle = {role: _threads(pid) for role, pid in pids.items()}
    stub = generation_stub(cluster.ready["router"])
    peak: dict[str, int] = dict(idle)
    outcomes: list[str] = []

    def stream(i: int) -> None:
        _, _, finish = generate(
            stub,
            token_ids=generate_pb2.TokenIds(ids=real_text_ids[i * 7 : i * 7 + 12]),
            sampling=_sampling(6),
        )
        outcomes.append(finish)

    workers = [threading.Thread(target=stream, args=(i,)) for i in range(200)]
    for w in workers:
        w.start()
    while any(w.is_alive() for w in workers):
        peak = {role: max(peak[role], _threads(pid)) for role, pid in pids.items()}
        time.sleep(0.2)
    assert outcomes.count("length") == 200
    assert peak["decode"] > idle["decode"] + THREADS_ABOVE_IDLE, (idle, peak)  # it did grow
    assert _wait_for(
        lambda: all(_threads(pid) <= idle[r] + THREADS_ABOVE_IDLE for r, pid in pids.items()),
        timeout=20,
    ), (idle, peak, {r: _threads(pid) for r, pid in pids.items()})
