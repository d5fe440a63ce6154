"""Request migration: a stream whose decode worker fails continues on another one.

When a decode worker dies (its call ends UNAVAILABLE, or CANCELLED by its side), stalls while
failing its health checks (`watchdog.py`), or the prefill worker holding the request's KV dies
before the KV landed, the router does not end the request: it prefills the prompt plus every
token the client already has (the `output_token_ids` of PrefillRequest / DecodeRequest) on
another worker, and decodes from the next token. The engine treats those tokens as outputs, so
max_tokens, the penalties and the seeded stream (each draw seeded by (seed, output index),
`services/engine/sampler.py`) carry on exactly; the router's own state (detokenizer, stop
strings, usage, logprobs already sent) lives in the request's `TextStream` and `RequestStats`
and simply carries on too. The client sees one stream with no token repeated or lost.
Dynamo's request migration does the same for a dead worker (re-sending prompt + generated
tokens); pdserve also carries the sampling state and catches stalls.

Bounded: at most `MigrationConfig.max_migrations` moves per request, each waiting at most
`migration_wait` seconds for a healthy worker; then UNAVAILABLE naming the worker. Each move
is logged with the request id and its reason and counted in
`pdserve_request_migrations_total{reason}` and the request's timings.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from services.common.errors import failed_peer


@dataclass
class WorkerLost(Exception):
    """A worker a request depended on failed mid-request; the request may move elsewhere."""

    role: str  # "prefill" | "decode": whose pool the next attempt needs a healthy worker of
    address: str  # HOST:PORT of the failed worker
    reason: str  # a `metrics.MIGRATION_REASONS` value
    detail: str  # what the failed call said

    def __str__(self) -> str:
        return f"{self.role} worker {self.address}: {self.detail} ({self.reason})"


def decode_failure(
    exc: grpc.RpcError,
    address: str,
    kv_source: str | None,
    kv_landed: bool,
    stalled: bool,
) -> WorkerLost | None:
    """Classifies an error of the Decode call to `address` of a request that was not
    cancelled: a WorkerLost when the request should move (its decode worker failed, stalled,
    or its KV source `kv_source` died before the KV landed), None when the error is the
    request's own (bad input, a full queue, its deadline) and ends it."""
    code, detail = exc.code(), exc.details() or ""
    if stalled:
        return WorkerLost("decode", address, "decode_stalled", "no token while unhealthy")
    if code == grpc.StatusCode.UNAVAILABLE:
        peer = failed_peer(exc)
        if peer is None:
            return WorkerLost("decode", address, "decode_failed", detail)
        if peer == kv_source and not kv_landed:
            return WorkerLost("prefill", peer, "kv_lost", detail)
        return None
    if code == grpc.StatusCode.CANCELLED:
        # Not by this request (the caller checked), so by the worker's side: its server
        # stopped (SIGTERM past the drain), or the pool dropped its channel (it left).
        return WorkerLost("decode", address, "decode_failed", detail or "call cancelled")
    return None
