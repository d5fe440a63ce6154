"""The OpenAI HTTP API of a real `pdserve serve` cluster, driven by the official `openai`
client: completions and chat against the gRPC API, n (seeded samples; greedy copies that share
the prompt's KV blocks), lists of prompts, logprobs, the usage chunk, models, 404; overload of
a small cluster (admission control); stalled clients; the API key passed through the
environment."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from services.common.pb import common_pb2, generate_pb2
from tests.e2e.cluster import generation_stub, scrape, worker_info
from tests.e2e.conftest import KEY, MAX_NUM_SEQS, MAX_QUEUED, READ_TIMEOUT_S

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def cluster(openai_cluster):
    return openai_cluster


def _client(cluster, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.ready["http"] + "/v1", api_key=key, max_retries=0)


def _service(cluster, role: str) -> dict:
    return next(s for s in cluster.ready["services"] if s["role"] == role)


def _model(cluster) -> str:
    return _client(cluster).models.list().data[0].id


def _grpc_text(cluster, max_tokens: int, **sampling) -> str:
    stub = generation_stub(cluster.ready["router"])
    request = dict(
        text=PROMPT,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling),
    )
    metadata = (("authorization", f"Bearer {KEY}"),)
    text = ""
    for msg in stub.Generate(
        generate_pb2.GenerateRequest(**request), timeout=60, metadata=metadata
    ):
        text += msg.text
    return text


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) / 1024


def test_the_key_never_appears_on_a_command_line(cluster):
    for service in cluster.ready["services"]:
        with open(f"/proc/{service['pid']}/cmdline", "rb") as f:
            assert KEY.encode() not in f.read()
    with pytest.raises(openai.AuthenticationError):
        _client(cluster, "wrong").models.list()
    argv = [sys.executable, "-m", "services.cli.main", "generate", "--url", cluster.ready["router"]]
    argv += ["--prompt", PROMPT, "--max-tokens", "2"]
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}
    refused = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    served = subprocess.run([*argv, "--api-key", KEY], capture_output=True, text=True, timeout=60)
    assert served.returncode == 0 and served.stdout.strip()


def test_completion_and_chat_match_the_grpc_api(cluster):
    client, model = _client(cluster), _model(cluster)
    expected = _grpc_text(cluster, 12, temperature=0.0)
    reply = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].text == expected and reply.usage.completion_tokens == 12
    streamed = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content and chat.choices[0].finish_reason in ("stop", "length")


def _prompt_cost(cluster, prompt: str, n: int) -> tuple[list[str], int, int, float]:
    """(texts, prompt tokens, prompt tokens the prefill worker computed, KV bytes the decode
    worker pulled) of one greedy request with `n` choices."""
    client = _client(cluster)
    prefill, metrics = _service(cluster, "prefill")["grpc"], _service(cluster, "decode")["metrics"]
    computed = worker_info(prefill, "prefill").num_prompt_tokens_computed
    pulled = scrape(metrics, "pdserve_kv_transfer_bytes_total", "decode")
    reply = client.completions.create(
        model=_model(cluster),
        prompt=prompt,
        n=n,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    computed = worker_info(prefill, "prefill").num_prompt_tokens_computed - computed
    pulled = scrape(metrics, "pdserve_kv_transfer_bytes_total", "decode") - pulled
    for choice in reply.choices:  # each choice's legs add up, its wait behind the leader too
        t = choice.model_extra["timings"]
        to_first = t["router_queue"] + t["tokenize"] + t["prefill_queue"] + t["prefill"]
        rest = t["decode_queue"] + t["kv_transfer"] + t["first_decode_step"] + t["decode"]
        assert abs(to_first - t["ttft"]) <= max(0.1 * t["ttft"], 0.005), (choice.index, t)
        assert abs(to_first + rest - t["e2e"]) <= max(0.1 * t["e2e"], 0.005), (choice.index, t)
    return [c.text for c in reply.choices], reply.usage.prompt_tokens, computed, pulled


def test_n_greedy_copies_equal_the_grpc_answer_and_share_the_prompt_blocks(cluster):
    """n=3 at temperature 0: three equal answers, equal to n=1's; the prompt is computed once
    plus two tails (< one 16-token block each), and its full blocks are pulled once."""
    filler = " " + "and so on, " * 20  # several full 16-token blocks
    one, num_one, computed_one, pulled_one = _prompt_cost(cluster, "Spain:" + filler, 1)
    three, num, computed, pulled = _prompt_cost(cluster, "France:" + filler, 3)
    print(
        f"n=1: {num_one} prompt tokens, {computed_one} computed, {pulled_one:.0f} bytes pulled; "
        f"n=3: {num} prompt tokens, {computed} computed, {pulled:.0f} bytes pulled"
    )
    assert computed_one == num_one and len(three) == 3 and len(set(three)) == 1
    assert three[0] == _prompt_cost(cluster, "France:" + filler, 1)[0][0]
    assert computed <= num + 2 * 16, (computed, num)
    per_token = pulled_one / num_one
    assert pulled <= (num + 2 * 16) * per_token * 1.01, (pulled, num, per_token)


def test_n_seeded_samples_are_reproducible_and_differ(cluster):
    client, model = _client(cluster), _model(cluster)

    def sample() -> list[str]:
        reply = client.completions.create(
            model=model, prompt=PROMPT, n=3, max_tokens=16, temperature=1.0, seed=11
        )
        return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]

    first = sample()
    assert sample() == first and len(set(first)) > 1


def test_a_list_of_prompts_gets_one_choice_each(cluster):
    client, model = _client(cluster), _model(cluster)
    reply = client.completions.create(
        model=model, prompt=[PROMPT, "One, two,"], max_tokens=4, temperature=0
    )
    assert [c.index for c in reply.choices] == [0, 1]
    assert (
        reply.choices[0].text
        == _grpc_text(cluster, 4, temperature=0.0)[: len(reply.choices[0].text)]
    )


def test_logprobs_models_and_unknown_model(cluster):
    client, model = _client(cluster), _model(cluster)
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == 3 and all(len(t) == 2 for t in logprobs.top_logprobs)
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=PROMPT)


def test_overload_is_refused_at_once_and_accepted_streams_complete(cluster):
    """10x more concurrent streams than 8 running + 4 queued: the excess gets 429 without
    waiting; every accepted stream completes with the greedy answer; RSS and threads stay
    bounded."""
    client, model = _client(cluster), _model(cluster)
    expected = _grpc_text(cluster, 24, temperature=0.0)
    pids = {s["role"]: s["pid"] for s in cluster.ready["services"]}
    idle = {role: (_threads(pid), _rss_mib(pid)) for role, pid in pids.items()}
    router_metrics = _service(cluster, "router")["metrics"]
    rejected_before = _rejected(router_metrics)
    num = 10 * (MAX_NUM_SEQS + MAX_QUEUED)
    barrier = threading.Barrier(num)

    def one(_: int) -> tuple[str, float, str]:
        barrier.wait()
        start = time.monotonic()
        try:
            stream = client.completions.create(
                model=model,
                prompt=PROMPT,
                max_tokens=24,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            return "ok", time.monotonic() - start, "".join(c.choices[0].text for c in stream)
        except openai.RateLimitError as exc:
            assert exc.response.headers["retry-after"] == "1"
            return "429", time.monotonic() - start, ""

    peak = {role: (0, 0.0) for role in pids}
    with ThreadPoolExecutor(num) as pool:
        futures = [pool.submit(one, i) for i in range(num)]
        while not all(f.done() for f in futures):
            for role, pid in pids.items():
                peak[role] = (max(peak[role][0], _threads(pid)), max(peak[role][1], _rss_mib(pid)))
            time.sleep(0.05)
        results = [f.result() for f in futures]
    accepted = [r for r in results if r[0] == "ok"]
    refused = [r for r in results if r[0] == "429"]
    print(
        f"overload: {num} streams, {len(accepted)} accepted, {len(refused)} refused in at most "
        f"{max((r[1] for r in refused), default=0) * 1000:.0f} ms; idle {idle}, peak {peak}"
    )
    assert len(accepted) + len(refused) == num
    assert MAX_NUM_SEQS <= len(accepted) <= num // 2, len(accepted)
    assert all(text == expected for _, _, text in accepted)
    assert max(seconds for _, seconds, _ in refused) < 2.0  # refused at once, never queued
    assert _rejected(router_metrics) - rejected_before == len(refused)
    for role in pids:  # bounds: a thread per in-flight stream, and little memory
        assert peak[role][0] <= idle[role][0] + 2 * num, (role, idle[role], peak[role])
        assert peak[role][1] <= idle[role][1] + 300, (role, idle[role], peak[role])


def _rejected(metrics_url: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    prefix = 'pdserve_requests_rejected_total{reason="queue_full",role="router"} '
    return next(
        (float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)), 0.0
    )


def test_stalled_clients_are_closed_and_cost_no_thread(cluster):
    """200 connections send half a body and stall: a normal request is served meanwhile, the
    stalled ones get 408 after the read timeout, and the router's threads return to idle."""
    client, model = _client(cluster), _model(cluster)
    client.completions.create(model=model, prompt=PROMPT, max_tokens=2)  # warm the thread pool
    router_pid = _service(cluster, "router")["pid"]
    idle = _threads(router_pid)
    host, port = cluster.ready["http"].removeprefix("http://").split(":")
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 200\r\n\r\n"
    ).encode()
    socks = []
    for _ in range(200):
        sock = socket.create_connection((host, int(port)), timeout=30)
        sock.sendall(head + b'{"prompt": "half a bo')
        socks.append(sock)
    start = time.monotonic()
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=8)
    latency = time.monotonic() - start
    print(f"normal request among 200 stalled connections: {latency * 1000:.0f} ms")
    assert reply.choices[0].text and latency < READ_TIMEOUT_S
    assert _threads(router_pid) <= idle + 2
    for sock in socks:
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        assert data.startswith(b"HTTP/1.1 408"), data[:80]
        sock.close()
    assert time.monotonic() - start < READ_TIMEOUT_S + 10
    deadline = time.monotonic() + 10
    while _threads(router_pid) > idle and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _threads(router_pid) <= idle
    text = json.dumps({"prompt": PROMPT, "max_tokens": 2})
    assert client.completions.create(model=model, **json.loads(text)).choices[0].text


PENALTY_CASES = {
    "repetition": dict(repetition_penalty=1.8),
    "presence": dict(presence_penalty=2.0),
    "frequency": dict(frequency_penalty=1.5),
    "logit_bias": None,  # filled in from the plain answer
    "combined": dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5),
}


@pytest.mark.parametrize("case", list(PENALTY_CASES))
def test_penalties_and_logit_bias_over_http_match_the_reference(
    cluster, default_model, real_text_ids, case
):
    """Each penalty and logit_bias through the OpenAI API changes the greedy answer exactly as
    transformers' logits with reference processors (in vLLM's order) do; the gRPC API gives
    the token ids, the HTTP API the same text."""
    from services.engine import SamplingParams
    from tests.engine.test_penalties_reference import _reference_processors
    from tests.reference import assert_equivalent, hf_greedy

    prompt, max_tokens = real_text_ids[5000:5040], 16
    plain = hf_greedy(default_model, prompt, max_tokens)
    kwargs = PENALTY_CASES[case] or {"logit_bias": {plain.token_ids[0]: -100.0}}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)
    ref = hf_greedy(default_model, prompt, max_tokens, _reference_processors(params, len(prompt)))
    assert ref.token_ids != plain.token_ids  # the case does change the answer
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for name, value in kwargs.items():
        if name == "logit_bias":
            sampling.logit_bias.update(value)
        else:
            setattr(sampling, name, value)
    stub = generation_stub(cluster.ready["router"])
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt), sampling=sampling
    )
    ids, text = [], ""
    for msg in stub.Generate(request, timeout=60, metadata=(("authorization", f"Bearer {KEY}"),)):
        ids += list(msg.token_ids)
        text += msg.text
    assert_equivalent(ids, ref, case)
    body = {
        k: ({str(t): b for t, b in v.items()} if k == "logit_bias" else v)
        for k, v in kwargs.items()
    }
    reply = _client(cluster).completions.create(
        model=_model(cluster),
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True, **body},
    )
    assert reply.choices[0].text == text
