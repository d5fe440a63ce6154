"""The OpenAI-style HTTP API (services/router/openai/app.py) through the fake workers:
completions and chat completions, streaming, logprobs, client disconnects, bad input (400),
overload (429), health and models, and cache_salt."""

from __future__ import annotations

import json
import socket
import urllib.request

import grpc
import pytest

from tests.router.fakes import (
    CANCEL_WAIT_S,
    PROMPT,
    _completion_ids,
    _post,
    _script,
    _wait_until,
)


def test_http_completion(cluster, tokenizer):
    ids = _completion_ids(tokenizer)
    _script(cluster, ids)
    status, data = _post(
        cluster[0].http.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": len(ids)}
    )
    body = json.loads(data)
    assert status == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == tokenizer.decode(ids)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == len(ids)


def test_http_completion_stream(cluster, tokenizer):
    ids = _completion_ids(tokenizer)
    _script(cluster, ids)
    payload = {
        "prompt": PROMPT,
        "stream": True,
        "stop": "STOP",
        "stream_options": {"include_usage": True},
    }
    status, data = _post(cluster[0].http.url + "/v1/completions", payload)
    events = [line[len("data: ") :] for line in data.decode().split("\n\n") if line]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == " The answer is 42. "
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize("stream", [True, False])
def test_http_client_disconnect_cancels_the_decode_stream(cluster, tokenizer, stream):
    ids = _completion_ids(tokenizer)
    _script(cluster, ids, endless_token=ids[1])
    http = cluster[0].http
    body = json.dumps({"prompt": PROMPT, "max_tokens": 5000, "stream": stream}).encode()
    sock = socket.create_connection((http.host, http.port), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    if stream:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # headers, then events follow
    assert _wait_until(lambda: cluster[2].requests)  # the decode stream is running
    sock.close()
    assert cluster[2].cancelled.wait(CANCEL_WAIT_S), "the router did not cancel the decode stream"


def test_http_completion_logprobs(cluster, tokenizer):
    ids = _completion_ids(tokenizer)
    _script(cluster, ids)
    status, data = _post(
        cluster[0].http.url + "/v1/completions",
        {"prompt": PROMPT, "max_tokens": len(ids), "logprobs": 2},
    )
    logprobs = json.loads(data)["choices"][0]["logprobs"]
    assert status == 200 and cluster[1].requests[0].sampling.logprobs == 2
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert logprobs["token_logprobs"] == [-0.5] * len(ids)
    assert logprobs["top_logprobs"][0] == {
        tokenizer.decode([ids[0]]): -0.5,
        tokenizer.decode([ids[0] + 1]): -1.5,
    }
    assert logprobs["text_offset"][1] == len(logprobs["tokens"][0])


@pytest.mark.parametrize("stream", [False, True])
def test_http_chat_logprobs(cluster, tokenizer, stream):
    ids = _completion_ids(tokenizer)
    _script(cluster, ids)
    payload = {
        "messages": [{"role": "user", "content": "hi"}],
        "logprobs": True,
        "top_logprobs": 1,
        "stream": stream,
    }
    status, data = _post(cluster[0].http.url + "/v1/chat/completions", payload)
    assert status == 200
    if stream:
        chunks = [
            json.loads(line[len("data: ") :])
            for line in data.decode().split("\n\n")
            if line and "[DONE]" not in line
        ]
        content = [
            entry
            for c in chunks
            if c["choices"][0]["logprobs"]
            for entry in c["choices"][0]["logprobs"]["content"]
        ]
    else:
        content = json.loads(data)["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [tokenizer.decode([t]) for t in ids]
    assert all(entry["logprob"] == -0.5 and len(entry["top_logprobs"]) == 1 for entry in content)
    assert content[0]["bytes"] == list(content[0]["token"].encode())


def test_http_chat_completion_uses_the_chat_template(cluster, model_info, tokenizer):
    ids = _completion_ids(tokenizer)
    _script(cluster, ids)
    messages = [{"role": "user", "content": "hi"}]
    status, data = _post(cluster[0].http.url + "/v1/chat/completions", {"messages": messages})
    body = json.loads(data)
    assert status == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": tokenizer.decode(ids)}
    expected = tokenizer.encode(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    assert list(cluster[1].requests[0].prompt_token_ids) == expected


@pytest.mark.parametrize(
    "path, payload, field",
    [
        ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": PROMPT, "stream": True, "top_p": 2}, "top_p"),
        ("/v1/completions", {"max_tokens": 4}, "prompt"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": "many"}, "max_tokens"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        # Malformed messages: named, never a 500 (a new user's finding).
        ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [5]}, "messages[0]"),
        ("/v1/chat/completions", {"messages": ["hi"]}, "messages[0]"),
        ("/v1/chat/completions", {"messages": [["user", "hi"]]}, "messages[0]"),
        ("/v1/chat/completions", {"messages": [7], "stream": True}, "messages[0]"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
            "top_logprobs",
        ),
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 1}, "echo"),
        ("/v1/completions", {"prompt": PROMPT, "suffix": "x"}, "suffix"),
        ("/v1/completions", {"prompt": PROMPT, "n": 0}, "n"),
        ("/v1/completions", {"prompt": PROMPT, "n": 17}, "n"),
        ("/v1/completions", {"prompt": PROMPT, "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": PROMPT, "cache_salt": 5}, "cache_salt"),
        ("/v1/completions", {"prompt": PROMPT, "cache_salt": ""}, "cache_salt"),
        ("/v1/completions", {"prompt": PROMPT, "cache_salt": "s" * 1025}, "cache_salt"),
    ],
)
def test_http_bad_input_is_400_naming_the_field(cluster, path, payload, field):
    status, data = _post(cluster[0].http.url + path, payload)
    error = json.loads(data)["error"]
    assert status == 400 and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{field}:") and error["param"] == field


def test_http_overload_is_429(cluster):
    cluster[1].reset([1], error=grpc.StatusCode.RESOURCE_EXHAUSTED)
    status, data = _post(cluster[0].http.url + "/v1/completions", {"prompt": PROMPT})
    assert status == 429 and json.loads(data)["error"]["message"]


def test_http_health_and_models(cluster, model_info):
    url = cluster[0].http.url
    with urllib.request.urlopen(url + "/health", timeout=10) as reply:
        assert reply.status == 200
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as reply:
        model = json.loads(reply.read())["data"][0]
    assert (
        model["id"] == str(model_info.path) and model["max_model_len"] == model_info.max_model_len
    )
    assert json.loads(cluster[0].ready_line()[len("ready ") :])["http"] == url


def test_cache_salt_reaches_both_workers_and_cached_tokens_reach_usage(cluster, tokenizer):
    ids = _completion_ids(tokenizer)
    _script(cluster, ids)
    cluster[1].cached_tokens = 32
    status, data = _post(
        cluster[0].http.url + "/v1/completions",
        {"prompt": PROMPT, "max_tokens": len(ids), "cache_salt": "tenant-a"},
    )
    assert status == 200
    assert json.loads(data)["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert cluster[1].requests[-1].cache_salt == cluster[2].requests[-1].cache_salt == "tenant-a"


def test_the_objective_headers_reach_the_decode_worker(cluster, tokenizer):
    """x-slo-itl-ms and x-slo-tpot-ms (llm-d's x-slo-* headers, milliseconds) ride the Decode
    call; a bad one is a 400 naming the header; none sends 0, the decode worker's default."""
    ids = _completion_ids(tokenizer)
    url = cluster[0].http.url + "/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": len(ids)}
    _script(cluster, ids)
    assert _post(url, body, {"x-slo-itl-ms": "75.5", "x-slo-tpot-ms": "40"})[0] == 200
    sent = cluster[2].requests[-1]
    assert (sent.itl_objective_ms, sent.tpot_objective_ms) == (75.5, 40.0)
    _script(cluster, ids)
    assert _post(url, body)[0] == 200
    sent = cluster[2].requests[-1]
    assert (sent.itl_objective_ms, sent.tpot_objective_ms) == (0.0, 0.0)
    for header in ("x-slo-ttft-ms", "x-slo-itl-ms", "x-slo-tpot-ms"):
        for bad in ("0", "-3", "fast", "inf"):
            status, data = _post(url, body, {header: bad})
            error = json.loads(data)["error"]
            assert status == 400 and error["message"].startswith(f"{header}: must be a number")
            assert error["param"] == header
