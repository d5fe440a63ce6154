"""`pdserve serve` as a supervisor: its only decode worker SIGKILLed mid-stream is restarted on
its port, the stream completes there with the reference output, and `serve` keeps serving."""

from __future__ import annotations

import os
import signal
import time

from services.common.pb import common_pb2, generate_pb2
from tests.e2e.cluster import generation_stub, pid_alive, start
from tests.reference import assert_equivalent, hf_greedy

NUM_TOKENS = 120


def test_serve_restarts_a_killed_decode_worker_and_its_stream_completes(
    tmp_path, default_model, real_text_ids
):
    log = tmp_path / "serve.log"
    prompt = real_text_ids[2500:2540]
    reference = hf_greedy(default_model, prompt, NUM_TOKENS)
    with log.open("w") as stderr:
        serve = start(
            "serve", "--port", "0", "--no-http", "--num-prefill", "1", "--num-decode", "1",
            "--kv-cache-bytes", str(96 << 20), stderr=stderr,
        )  # fmt: skip
    try:
        (decode,) = [s for s in serve.ready["services"] if s["role"] == "decode"]
        stub = generation_stub(serve.ready["router"])
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(
                max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True
            ),
        )
        tokens, last, killed = [], None, False
        for msg in stub.Generate(request, timeout=120):
            tokens += msg.token_ids
            last = msg
            if not killed and len(tokens) >= 30:
                os.kill(decode["pid"], signal.SIGKILL)
                killed = True
        assert killed and last.finish_reason == "length" and last.timings.migrations == 1
        assert_equivalent(tokens, reference, context="stream over a restarted decode worker")
        assert serve.process.poll() is None  # serve kept running
        text = log.read_text()
        assert "decode-0 restarted (pid " in text and "decode-0 is serving again at" in text
        assert f"is serving again at {decode['grpc']}" in text  # on its old address
        assert not pid_alive(decode["pid"])
        # and the cluster serves new requests
        request.sampling.max_tokens = 4
        answer = list(stub.Generate(request, timeout=60))
        assert answer[-1].finish_reason == "length"
    finally:
        started = time.monotonic()
        assert serve.stop(timeout=60) == 0
        assert time.monotonic() - started < 60
