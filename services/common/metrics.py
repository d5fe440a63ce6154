"""Prometheus metric definitions (docs/architecture.md names: `pdserve_` prefix, base units, `role`
label).

Every process has one registry; `start_metrics_server` exposes it on /metrics.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

# Latency buckets in seconds, 1 ms to 2 min, with the common SLOs on a boundary (TTFT 100, 200,
# 500 ms, 1, 2 s; TPOT 20, 50, 100 ms) so SLO attainment reads exactly off the buckets
# (docs/architecture.md; vLLM's dashboards compute it the same way).
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
)
SWITCH_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

TIME_TO_FIRST_TOKEN = Histogram(
    "pdserve_time_to_first_token_seconds",
    "Request received -> first token sent.",
    ["role"],
    buckets=LATENCY_BUCKETS,
)
TIME_PER_OUTPUT_TOKEN = Histogram(
    "pdserve_time_per_output_token_seconds",
    "(E2E - TTFT) / (output tokens - 1), per request.",
    ["role"],
    buckets=LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "pdserve_inter_token_latency_seconds",
    "Gap between consecutive streamed tokens.",
    ["role"],
    buckets=LATENCY_BUCKETS,
)
E2E_REQUEST_LATENCY = Histogram(
    "pdserve_e2e_request_latency_seconds",
    "Request received -> last token sent.",
    ["role"],
    buckets=LATENCY_BUCKETS,
)
PREFILL_TIME = Histogram(
    "pdserve_prefill_time_seconds",
    "Prefill RPC duration seen by the router.",
    ["role"],
    buckets=LATENCY_BUCKETS,
)
KV_TRANSFER_TIME = Histogram(
    "pdserve_kv_transfer_seconds",
    "Pulling one request's prompt KV.",
    ["role"],
    buckets=LATENCY_BUCKETS,
)
KV_TRANSFER_BYTES = Counter(
    "pdserve_kv_transfer_bytes", "KV bytes moved between workers, by backend.", ["role", "backend"]
)
KV_BACKENDS = ("grpc", "shared_memory", "cuda_ipc", "torch_dist")  # kv_transfer.registry.DATA_PATHS
KV_TRANSFER_FAILURES = Counter(
    "pdserve_kv_transfer_failures",
    "Transfers that failed, by reason: unavailable, deadline_exceeded, not_found, handshake "
    "(refused layouts), lease_expired (prefill: nobody pulled in time), kv_timeout (decode: KV "
    "never arrived).",
    ["role", "reason"],
)
KV_FAILURE_REASONS = (
    "unavailable",
    "deadline_exceeded",
    "not_found",
    "handshake",
    "lease_expired",
    "kv_timeout",
)
KV_BLOCKS_FREE = Gauge("pdserve_kv_blocks_free", "Free KV blocks.", ["role"])
KV_BLOCKS_PINNED = Gauge("pdserve_kv_blocks_pinned", "KV blocks pinned for a transfer.", ["role"])
KV_CACHE_USAGE = Gauge("pdserve_kv_cache_usage_ratio", "Used / total KV blocks.", ["role"])
NUM_REQUESTS_RUNNING = Gauge(
    "pdserve_num_requests_running", "Requests in the running batch.", ["role"]
)
NUM_REQUESTS_WAITING = Gauge(
    "pdserve_num_requests_waiting", "Requests waiting for blocks or a slot.", ["role"]
)
PREFIX_CACHE_QUERIES = Counter(
    "pdserve_prefix_cache_queries",
    "Tokens looked up in the prefix cache when a request was admitted.",
    ["role"],
)
PREFIX_CACHE_HITS = Counter(
    "pdserve_prefix_cache_hits",
    "Looked-up tokens whose KV the prefix cache already held.",
    ["role"],
)
NUM_PREEMPTIONS = Counter(
    "pdserve_num_preemptions", "Requests preempted (recomputed later).", ["role"]
)
PROMPT_TOKENS = Counter(
    "pdserve_prompt_tokens",
    "Prompt tokens of admitted requests (router: counted when the request's first token comes, "
    "so a refused or failed-before-prefill request adds none; workers: when they accept one).",
    ["role"],
)
DECODE_RECOMPUTED_PROMPT_TOKENS = Counter(
    "pdserve_decode_recomputed_prompt_tokens",
    "Prompt positions a decode worker ran through the model, by cause: local_prefill (the "
    "router sent the prompt without KV), preemption (its KV was freed and recomputed), fallback "
    "(the request came with remote KV, which should have made this 0).",
    ["role", "cause"],
)
GENERATION_TOKENS = Counter("pdserve_generation_tokens", "Tokens generated.", ["role"])
REQUEST_SUCCESS = Counter(
    "pdserve_request_success", "Finished requests.", ["role", "finish_reason"]
)
FINISH_REASONS = ("stop", "length")
REQUEST_ERRORS = Counter(
    "pdserve_request_errors",
    "Requests that ended in an error, by gRPC code (the HTTP API counts its 4xx/5xx under the "
    "code they map to), refusals before any work included.",
    ["role", "code"],
)
ERROR_CODES = (
    "INVALID_ARGUMENT",
    "UNAUTHENTICATED",
    "NOT_FOUND",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "CANCELLED",
    "DEADLINE_EXCEEDED",
    "UNAVAILABLE",
    "INTERNAL",
)
MIGRATION_REASONS = ("decode_failed", "decode_stalled", "kv_lost")
REQUEST_MIGRATIONS = Counter(
    "pdserve_request_migrations",
    "Times a stream moved to another decode worker, by reason: decode_failed (its worker died "
    "or ended the call), decode_stalled (no token while the worker failed its health checks), "
    "kv_lost (the prefill worker holding its KV died before the KV landed).",
    ["role", "reason"],
)
REQUEST_PROMPT_TOKENS = Histogram(
    "pdserve_request_prompt_tokens",
    "Prompt tokens per finished request.",
    ["role"],
    buckets=TOKEN_BUCKETS,
)
REQUEST_GENERATION_TOKENS = Histogram(
    "pdserve_request_generation_tokens",
    "Generated tokens per finished request.",
    ["role"],
    buckets=TOKEN_BUCKETS,
)
WORKER_HEALTHY = Gauge(
    "pdserve_worker_healthy",
    "1 while a worker passes the router's health checks, else 0.",
    ["role", "worker"],
)


def forget_worker(address: str) -> None:
    """Drop a worker's `pdserve_worker_healthy` series once it left the router's pool (else
    a replaced Ray replica would show as down forever)."""
    try:
        WORKER_HEALTHY.remove("router", address)
    except KeyError:
        pass


KV_CACHE_BYTES = Gauge(
    "pdserve_kv_cache_bytes", "KV cache bytes by state (free, used, pinned).", ["role", "state"]
)
TOKENIZE_TIME = Histogram(
    "pdserve_tokenize_time_seconds", "Prompt tokenization.", ["role"], buckets=LATENCY_BUCKETS
)
REQUESTS_REJECTED = Counter(
    "pdserve_requests_rejected",
    "Requests refused before any work (queue_full: admission control).",
    ["role", "reason"],
)
SEQUENCES_IN_FLIGHT = Gauge(
    "pdserve_sequences_in_flight",
    "Sequences admitted by the router and not yet finished (running or queued).",
    ["role"],
)
REQUEST_LEG_TIME = Histogram(
    "pdserve_request_leg_seconds",
    "Where finished requests' time went, by leg (router_queue, tokenize, prefill_queue, "
    "prefill, kv_transfer, decode_queue, first_decode_step, decode; generate.proto Timings).",
    ["role", "leg"],
    buckets=LATENCY_BUCKETS,
)
REQUESTS_BY_PATH = Counter(
    "pdserve_requests",
    "Requests started, by serving path: remote (prefilled on the prefill pool) or local "
    "(prefilled on the decode worker).",
    ["role", "path"],
)
PATH_DECISIONS = Counter(
    "pdserve_router_path_decisions",
    "Serving-path decisions by path and reason: mode (--disaggregation always/never), length "
    "(the prompt-length rule: no fitted costs), predicted (the lower predicted TTFT) or "
    "objective (the least delay to running streams within the TTFT objective).",
    ["role", "path", "reason"],
)
PATH_CALIBRATION = Gauge(
    "pdserve_router_path_calibration_ratio",
    "Observed over predicted seconds to the first token of predicted serving-path choices, per "
    "path and decode worker state (idle or streaming: it had running streams), a weighted mean; "
    "the factor the router scales that path's next predictions in that state by.",
    ["role", "path", "decode"],
)
CORES_HELD = Gauge(
    "pdserve_cores_held",
    "CPUs this worker's engine computes on now (core lending: its own it has not lent, plus "
    "those it borrowed).",
    ["role"],
)
CORE_LENDS = Counter(
    "pdserve_core_lends", "Times this worker lent its idle CPUs to the node's other workers.",
    ["role"],
)  # fmt: skip
CORE_BORROWS = Counter(
    "pdserve_core_borrows", "Times this worker took another worker's lent CPUs for its steps.",
    ["role"],
)  # fmt: skip
CORE_MID_STEP_RETURNS = Counter(
    "pdserve_core_mid_step_returns",
    "Times this worker gave borrowed CPUs back to their reclaiming owner between two decoder "
    "layers of a step (the step's remaining layers ran on fewer threads).",
    ["role"],
)
CORE_LENT_SECONDS = Counter(
    "pdserve_core_lent_seconds",
    "Seconds this worker's own CPUs were lent (from its lend until it held them again).",
    ["role"],
)
CORE_RECLAIM_WAIT = Histogram(
    "pdserve_core_reclaim_wait_seconds",
    "A worker with work again, waiting for the borrower of its CPUs to end its step.",
    ["role"],
    buckets=LATENCY_BUCKETS,
)
CORE_REPIN_SECONDS = Histogram(
    "pdserve_core_repin_seconds",
    "Resizing and re-pinning the engine's OpenMP team after the CPUs it holds changed.",
    ["role"],
    buckets=SWITCH_BUCKETS,
)
STEP_PREFILL_BUDGET = Histogram(
    "pdserve_step_prefill_budget_tokens",
    "Prompt tokens the per-step token budget let a mixed step (a prompt chunk beside decode "
    "rows) compute: the largest chunk predicted to keep the running streams' ITL and TPOT "
    "objectives (engine/step_budget.py).",
    ["role"],
    buckets=(16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
)
STEP_TIME_SCALE = Gauge(
    "pdserve_step_time_scale_ratio",
    "Observed over predicted seconds of this worker's recent mixed steps at its current thread "
    "count (the step budget's live calibration, LiveScale): 1 is the fitted model as profiled.",
    ["role"],
)
HTTP_READ_TIMEOUTS = Counter(
    "pdserve_http_read_timeouts",
    "HTTP connections closed because a request's headers and body did not arrive in time.",
)


# A worker's counters, created at start-up so that one that has not moved yet reads 0 instead of
# being absent (what rate() and dashboards expect); the router has none of them.
WORKER_COUNTERS = (
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    NUM_PREEMPTIONS,
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    CORE_LENDS,
    CORE_BORROWS,
    CORE_MID_STEP_RETURNS,
    CORE_LENT_SECONDS,
)


def create_worker_series(role: str) -> None:
    """A worker's labelled series, created before anything moves them (each reads 0)."""
    for counter in WORKER_COUNTERS:
        counter.labels(role)
    for reason in KV_FAILURE_REASONS:
        KV_TRANSFER_FAILURES.labels(role, reason)
    for backend in KV_BACKENDS:
        KV_TRANSFER_BYTES.labels(role, backend)
    if role == "decode":
        KV_TRANSFER_TIME.labels(role)
    STEP_PREFILL_BUDGET.labels(role)
    STEP_TIME_SCALE.labels(role).set(1.0)


def observe_step_budget(role: str, tokens: int | None) -> None:
    """Record a step's prompt-token budget (`STEP_PREFILL_BUDGET`; None: the step was not a
    mixed step the budget sized)."""
    if tokens is not None:
        STEP_PREFILL_BUDGET.labels(role).observe(tokens)


def create_router_series(role: str = "router") -> None:
    """The router's labelled series (latencies, tokens, outcomes by label value), created at start
    so that panels and alerts have series before the first request or failure."""
    for histogram in (
        TIME_TO_FIRST_TOKEN,
        TIME_PER_OUTPUT_TOKEN,
        INTER_TOKEN_LATENCY,
        E2E_REQUEST_LATENCY,
        PREFILL_TIME,
        KV_TRANSFER_TIME,
        TOKENIZE_TIME,
        REQUEST_PROMPT_TOKENS,
        REQUEST_GENERATION_TOKENS,
    ):
        histogram.labels(role)
    PROMPT_TOKENS.labels(role)
    GENERATION_TOKENS.labels(role)
    SEQUENCES_IN_FLIGHT.labels(role)
    for reason in FINISH_REASONS:
        REQUEST_SUCCESS.labels(role, reason)
    for code in ERROR_CODES:
        REQUEST_ERRORS.labels(role, code)
    REQUESTS_REJECTED.labels(role, "queue_full")
    for reason in MIGRATION_REASONS:
        REQUEST_MIGRATIONS.labels(role, reason)


def start_metrics_server(host: str, port: int) -> int:
    """Serve /metrics on host:port (port 0 picks a free one); returns the bound port."""
    server, _ = start_http_server(port, addr=host)
    return server.server_port
