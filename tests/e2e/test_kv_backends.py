"""Greedy output through a `pdserve serve` cluster over each KV data path equals the
transformers reference and the gRPC path's, token for token; the chosen path is logged, and the
bytes are counted under its `backend` label on both sides."""

from __future__ import annotations

import pytest

from services.common.pb import common_pb2, generate_pb2
from services.kv_transfer.shared_memory.segment import count_segments, sweep_dead_segments
from tests.e2e.cluster import generation_stub, scrape, start
from tests.reference import assert_equivalent, hf_greedy

pytestmark = pytest.mark.e2e

NUM_TOKENS = 12
_OUTPUTS: dict[str, list[int]] = {}  # backend -> tokens, compared across the params


@pytest.mark.parametrize(
    ("flag", "backend"),
    [("grpc", "grpc"), ("auto", "shared_memory"), ("torch_dist", "torch_dist")],
)
def test_serve_over_each_kv_backend_matches_the_reference_and_grpc(
    flag, backend, tmp_path, default_model, real_text_ids
):
    prompt = real_text_ids[4000:4300]  # 300 tokens: 19 blocks of KV cross
    sweep_dead_segments()  # earlier tests' SIGKILLed workers': the new one would sweep them
    segments = count_segments()
    log = tmp_path / "serve.log"
    with log.open("w") as stderr:
        serve = start(
            "serve", "--port", "0", "--no-http", "--num-prefill", "1", "--num-decode", "1",
            "--kv-cache-bytes", str(64 << 20), "--kv-transfer-backend", flag,
            "--max-local-prefill-tokens", "0", stderr=stderr,  # every prompt's KV moves
        )  # fmt: skip
    try:
        assert count_segments() == segments + (backend == "shared_memory")
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(
                max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True
            ),
        )
        tokens = [t for m in generation_stub(serve.ready["router"]).Generate(request, timeout=120)
                  for t in m.token_ids]  # fmt: skip
        by_role = {s["role"]: s for s in serve.ready["services"]}
        for role in ("prefill", "decode"):
            moved = scrape(
                by_role[role]["metrics"],
                "pdserve_kv_transfer_bytes_total",
                role,
                backend=backend,
            )
            assert moved > 0, f"no KV bytes counted under backend={backend} at the {role}"
    finally:
        assert serve.stop(timeout=60) == 0
    assert f"over {backend}" in log.read_text()
    assert count_segments() == segments  # the prefill worker's segment went with it
    assert_equivalent(tokens, hf_greedy(default_model, prompt, NUM_TOKENS), context=backend)
    _OUTPUTS[backend] = tokens
    if "grpc" in _OUTPUTS:
        assert tokens == _OUTPUTS["grpc"], f"{backend} differs from the gRPC path"


def test_a_restarted_prefill_worker_serves_over_its_own_new_segment(
    tmp_path, default_model, real_text_ids
):
    """`serve` restarts a SIGKILLed prefill worker on its port: the decode worker must handshake
    with the new engine and copy from its new segment, not keep reading the dead worker's
    mapping (whose pages outlive it: answers would come back wrong, with no error)."""
    import os
    import signal
    import time

    from tests.e2e.cluster import pid_alive

    prompts = [real_text_ids[5000 + 400 * i : 5300 + 400 * i] for i in range(3)]
    log = tmp_path / "serve.log"
    with log.open("w") as stderr:
        serve = start(
            "serve", "--port", "0", "--no-http", "--num-prefill", "1", "--num-decode", "1",
            "--kv-cache-bytes", str(64 << 20), "--kv-transfer-backend", "shared_memory",
            "--disaggregation", "always", stderr=stderr,
        )  # fmt: skip
    try:
        stub = generation_stub(serve.ready["router"])

        def generate(prompt):
            request = generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=prompt),
                sampling=common_pb2.SamplingParams(
                    max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True
                ),
            )
            return [t for m in stub.Generate(request, timeout=120) for t in m.token_ids]

        before = generate(prompts[0])
        (prefill,) = [s for s in serve.ready["services"] if s["role"] == "prefill"]
        os.kill(prefill["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 90
        while "prefill-0 is serving again" not in log.read_text():
            assert time.monotonic() < deadline, "prefill-0 was not restarted"
            time.sleep(0.2)
        assert not pid_alive(prefill["pid"])
        after = [generate(p) for p in prompts[1:]]
    finally:
        assert serve.stop(timeout=60) == 0
    text = log.read_text()
    assert text.count("over shared_memory") == 2, "one handshake per prefill engine"
    for prompt, tokens in zip(prompts, [before, *after], strict=True):
        assert_equivalent(tokens, hf_greedy(default_model, prompt, NUM_TOKENS), context="restart")
