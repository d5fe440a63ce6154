"""The cluster of the OpenAI API tests (test_openai_api.py, test_api_fuzz.py)."""

from __future__ import annotations

import os

import pytest

from tests.e2e.cluster import start

MAX_NUM_SEQS = 8
MAX_QUEUED = 4
READ_TIMEOUT_S = 2.0
KEY = "sk-e2e"


@pytest.fixture(scope="module")
def openai_cluster():
    """`pdserve serve` with 8 running sequences, a queue of 4, a 2 s read timeout, and an API
    key it takes from the environment (as users pass secrets); a small KV cache. One per test
    module, stopped at its end: a cluster left running through the other e2e modules holds
    gigabytes they need."""
    os.environ["PDSERVE_API_KEY"] = KEY
    try:
        proc = start(
            "serve",
            "--port", "0",
            "--http-port", "0",
            "--max-num-seqs", str(MAX_NUM_SEQS),
            "--max-queued-requests", str(MAX_QUEUED),
            "--read-timeout", str(READ_TIMEOUT_S),
            "--kv-cache-bytes", str(256 << 20),
            "--max-local-prefill-tokens", "0",  # every prompt over the prefill pool and KV
        )  # fmt: skip
    finally:
        del os.environ["PDSERVE_API_KEY"]
    yield proc
    assert proc.stop() == 0
