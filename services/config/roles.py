"""One frozen, validated config per role: what each service is built from.

`RouterConfig`, `PrefillConfig` and `DecodeConfig` (each worker config holds its `EngineConfig`)
describe one service; `ClusterConfig` (`cluster/config.py`) describes a local cluster
(`pdserve serve`) and derives its children's configs. The CLI's flags are generated from these
fields (`services/flags.py`), `pdserve serve` hands each child its config as JSON
(`config/handoff.py`), and every service can be started in-process from its config object (the
tests, and the Ray deployment). Each default is written once; a new setting is a new field,
and every entry point gets it.

Imports no torch (the router and the CLI load this module).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from services.config import checks
from services.config.http import HttpConfig
from services.config.migration import MigrationConfig
from services.engine.config import DEFAULT_MODEL, EngineConfig, EngineRole
from services.flags import flag
from services.kv_transfer.registry import KV_TRANSFER_BACKENDS
from services.worker.cpus import parse_cpu_list

ROUTING_POLICIES = ("kv", "least_loaded", "round_robin")
DISAGGREGATION_MODES = ("auto", "always", "never")
COST_MODEL_MODES = ("auto", "saved", "off")
DEFAULT_ROUTER_PORT = 50051
DEFAULT_HTTP_PORT = 8000
API_KEY_ENV = "PDSERVE_API_KEY"  # the router's api_key when its config sets none


@dataclass(frozen=True, kw_only=True)
class PrefixIndexConfig:
    """Where the router learns which prefill worker caches which prefix."""

    redis_url: str | None = None
    """Prefix index in Redis, e.g. redis://127.0.0.1:6379/0 (None: in-process, approximate)."""
    index_ttl: float = 10.0
    """Seconds (> 0) a worker stays in the Redis index without a heartbeat."""

    def __post_init__(self) -> None:
        url, schemes = self.redis_url, ("redis://", "rediss://", "unix://")
        ok = url is None or isinstance(url, str) and url.startswith(schemes)
        checks.check(ok, "redis_url", "must be a redis:// URL or None", url)
        ok = checks.is_number(self.index_ttl) and self.index_ttl > 0
        checks.check(ok, "index_ttl", "must be > 0", self.index_ttl)


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """The router: public Generate API (gRPC, optional OpenAI HTTP), routing, worker pool."""

    model: str = DEFAULT_MODEL
    """The served model (its tokenizer, chat template and limits): a folder or known name."""
    host: str = "127.0.0.1"
    """Address every server of this service binds."""
    port: int = DEFAULT_ROUTER_PORT
    """gRPC port of the public Generate API (0 picks a free one)."""
    metrics_port: int = 0
    """Prometheus /metrics port (0 picks a free one)."""
    max_concurrent_rpcs: int | None = None
    """gRPC calls this service runs or queues for a thread at once; one more fails at once with
    RESOURCE_EXHAUSTED (default: 4096, or twice the service's handler threads if that is more)."""
    http_port: int | None = field(default=None, metadata=flag(no_flag="no-http"))
    """OpenAI-compatible HTTP port (0 picks a free one; None: no HTTP API)."""
    prefill: tuple[str, ...] = ()
    """A prefill worker's HOST:PORT (repeat the flag for each)."""
    decode: tuple[str, ...] = ()
    """A decode worker's HOST:PORT (repeat the flag for each)."""
    request_timeout: float = 300.0
    """Seconds a request may take when its client set no deadline."""
    routing: str = field(default="kv", metadata=flag(choices=ROUTING_POLICIES))
    """kv: prefix-cache overlap against load; least_loaded; round_robin."""
    index: PrefixIndexConfig = field(default_factory=PrefixIndexConfig)
    """The prefix index (shared with the prefill workers)."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens (None: the model's positions)."""
    max_queued_requests: int = 64
    """Requests admitted beyond what the decode pool runs at once (the sum of its workers'
    max_num_seqs); more get RESOURCE_EXHAUSTED / 429 with Retry-After at once, never a wait."""
    max_n: int = 16
    """Most sequences one request may ask for (OpenAI's `n`), per prompt."""
    disaggregation: str = field(default="auto", metadata=flag(choices=DISAGGREGATION_MODES))
    """auto: each prompt prefilled where its predicted TTFT is lower, on its decode worker or
    the prefill pool (see max_local_prefill_tokens); always: every prompt on the prefill pool;
    never: every prompt on its decode worker (colocated; no prefill worker needed)."""
    max_local_prefill_tokens: int | None = None
    """auto: longest prompt (tokens) prefilled on the decode worker, a fixed length rule. None:
    under `pdserve serve`'s core lending, the path of lower predicted TTFT from the workers'
    fitted step costs and the load (512 tokens until the workers report costs); without lending
    0 (docs/serving.md "Serving paths" gives the benchmarks behind each)."""
    slo_ttft_ms: float | None = None
    """TTFT objective (milliseconds) of a request that sets none (x-slo-ttft-ms): under auto's
    predicted rule, of the paths predicted to meet it a prompt takes the one that delays the
    running streams least. None: the path of lower predicted TTFT."""
    api_key: str | None = field(default=None, repr=False)
    """Clients must send it (HTTP `Authorization: Bearer KEY`, gRPC metadata `authorization`);
    /health and /metrics stay open (default: $PDSERVE_API_KEY, else none)."""
    http: HttpConfig = field(default_factory=HttpConfig)
    """The HTTP API's limits and timeouts."""
    migration: MigrationConfig = field(default_factory=MigrationConfig)
    """When a stream moves to another decode worker (its worker died or stalled)."""
    registration_ttl: float = 10.0
    """Seconds a worker that registered at run time (`--register-with`, or the Ray
    deployment's registry) stays in the pool without renewing."""
    cpus: str | None = None
    """CPU affinity, e.g. 0 or 0-1 (default: not pinned; `pdserve serve` sets its plan's)."""

    def __post_init__(self) -> None:
        checks.check(
            bool(self.model) and isinstance(self.model, str),
            "model",
            "must not be empty",
            self.model,
        )
        checks.check_listen(self.host, self.port, self.metrics_port)
        checks.check_max_concurrent_rpcs(self.max_concurrent_rpcs)
        if self.http_port is not None:
            checks.check_port("http_port", self.http_port)
        for name in ("prefill", "decode"):
            checks.check(
                isinstance(getattr(self, name), tuple),
                name,
                "must be a tuple of HOST:PORT",
                getattr(self, name),
            )
        checks.check(
            checks.is_number(self.request_timeout) and self.request_timeout > 0,
            "request_timeout",
            "must be > 0 seconds",
            self.request_timeout,
        )
        checks.check(
            self.routing in ROUTING_POLICIES,
            "routing",
            f"expected one of {ROUTING_POLICIES}",
            self.routing,
        )
        if self.max_model_len is not None:
            ok = isinstance(self.max_model_len, int) and self.max_model_len >= 1
            checks.check(ok, "max_model_len", "must be an integer >= 1", self.max_model_len)
        checks.check(
            self.disaggregation in DISAGGREGATION_MODES,
            "disaggregation",
            f"expected one of {DISAGGREGATION_MODES}",
            self.disaggregation,
        )
        for name, low in (
            ("max_queued_requests", 0),
            ("max_n", 1),
            ("max_local_prefill_tokens", 0),
        ):
            value = getattr(self, name)
            if name == "max_local_prefill_tokens" and value is None:
                continue
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
            checks.check(ok, name, f"must be an integer >= {low}", value)
        ok = self.slo_ttft_ms is None or checks.is_number(self.slo_ttft_ms) and self.slo_ttft_ms > 0
        checks.check(ok, "slo_ttft_ms", "must be > 0 milliseconds or None", self.slo_ttft_ms)
        checks.check(
            self.api_key is None or isinstance(self.api_key, str) and bool(self.api_key),
            "api_key",
            "must be a non-empty string or None",
            "<hidden>",
        )
        checks.check(isinstance(self.http, HttpConfig), "http", "must be an HttpConfig", self.http)
        ok = isinstance(self.migration, MigrationConfig)
        checks.check(ok, "migration", "must be a MigrationConfig", self.migration)
        checks.check(
            checks.is_number(self.registration_ttl) and self.registration_ttl > 0,
            "registration_ttl",
            "must be > 0 seconds",
            self.registration_ttl,
        )
        if self.cpus is not None:
            parse_cpu_list(self.cpus, flag="cpus")


def with_env_api_key(config: RouterConfig, environ: typing.Mapping[str, str]) -> RouterConfig:
    """`config` with `api_key` from $PDSERVE_API_KEY when it sets none (as vLLM's
    VLLM_API_KEY)."""
    key = environ.get(API_KEY_ENV)
    return dataclasses.replace(config, api_key=key) if config.api_key is None and key else config


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """What every worker process has: its engine, where it listens, its CPUs, its drain."""

    engine: EngineConfig = field(default_factory=EngineConfig, metadata=flag(exclude=("role",)))
    """The engine (its role is the worker's)."""
    host: str = "127.0.0.1"
    """Address this worker binds (a prefill worker also advertises it: decode workers pull KV
    from it)."""
    port: int = 0
    """gRPC port (0 picks a free one)."""
    metrics_port: int = 0
    """Prometheus /metrics port (0 picks a free one)."""
    max_concurrent_rpcs: int | None = None
    """gRPC calls this service runs or queues for a thread at once; one more fails at once with
    RESOURCE_EXHAUSTED (default: 4096, or twice the service's handler threads if that is more)."""
    threads: int | None = None
    """torch intra-op threads (default: one per CPU of `cpus`, else torch's own)."""
    cpus: str | None = None
    """CPU affinity, e.g. 0,1 or 0-3 (default: not pinned)."""
    drain_timeout: float = 30.0
    """On SIGTERM: seconds to finish in-flight requests (new ones are refused)."""
    register_with: tuple[str, ...] = ()
    """A router's HOST:PORT to join at start (Admin.RegisterWorker), renewing until a clean
    stop leaves it (repeat the flag for each router; default: the router lists this worker)."""
    kv_transfer_backend: str = field(default="auto", metadata=flag(choices=KV_TRANSFER_BACKENDS))
    """How prompt KV moves between workers: "auto" (shared memory between workers on one host,
    torch.distributed between GPU workers of one node, gRPC otherwise), or one of them forced.
    A prefill worker offers what it allows; a decode worker picks per prefill worker."""
    step_log: str | None = None
    """Append every engine step's shape, seconds and thread count to this JSON-lines file (the
    cost model's live check: `pdserve profile --check FILE`)."""
    core_ledger: str | None = None
    """The node's core ledger file (`pdserve serve` creates one): idle, this worker lends its
    CPUs to the node's other workers; busy, it borrows their lent ones. Its name there is its
    engine_id (less the suffix `pdserve serve` adds), and it may run on every CPU listed."""
    index: PrefixIndexConfig = field(default_factory=PrefixIndexConfig)
    """Where this worker publishes its prefix-cache events (Redis), if anywhere: the router
    routes prompts by what the prefill workers hold, and predicts a local prefill by what the
    decode worker holds."""

    role: typing.ClassVar[EngineRole]

    def __post_init__(self) -> None:
        checks.check(
            isinstance(self.engine, EngineConfig), "engine", "must be an EngineConfig", self.engine
        )
        checks.check_listen(self.host, self.port, self.metrics_port)
        checks.check_max_concurrent_rpcs(self.max_concurrent_rpcs)
        if self.threads is not None:
            ok = isinstance(self.threads, int) and not isinstance(self.threads, bool)
            checks.check(ok and self.threads >= 1, "threads", "must be >= 1", self.threads)
        if self.cpus is not None:
            parse_cpu_list(self.cpus, flag="cpus")
        checks.check(
            checks.is_number(self.drain_timeout) and self.drain_timeout >= 0,
            "drain_timeout",
            "must be >= 0 seconds",
            self.drain_timeout,
        )
        ok = isinstance(self.register_with, tuple)
        checks.check(ok, "register_with", "must be a tuple of HOST:PORT", self.register_with)
        checks.check(
            self.kv_transfer_backend in KV_TRANSFER_BACKENDS,
            "kv_transfer_backend",
            f"must be one of {', '.join(KV_TRANSFER_BACKENDS)}",
            self.kv_transfer_backend,
        )
        for name in ("step_log", "core_ledger"):
            value = getattr(self, name)
            ok = value is None or isinstance(value, str) and bool(value)
            checks.check(ok, name, "must be a file path or None", value)

    def engine_config(self) -> EngineConfig:
        """The engine this worker runs: its `engine` in the worker's role, recording
        prefix-cache events when a Redis index is set."""
        events = self.engine.enable_kv_events or self.index.redis_url is not None
        return dataclasses.replace(self.engine, role=self.role, enable_kv_events=events)


@dataclass(frozen=True, kw_only=True)
class PrefillConfig(WorkerConfig):
    """A prefill worker: runs prompts, pins their KV under a lease, serves it to decode workers."""

    engine: EngineConfig = field(
        default_factory=EngineConfig,
        metadata=flag(exclude=("role", "kv_transfer_timeout_s", "max_num_waiting_for_kv")),
    )
    """The engine (PREFILL role)."""
    debug_kv_stall_seconds: float = field(default=0.0, metadata=flag(hidden=True))
    """Test hook: hold every PullKV this long before its first chunk."""

    role: typing.ClassVar[EngineRole] = EngineRole.PREFILL


@dataclass(frozen=True, kw_only=True)
class DecodeConfig(WorkerConfig):
    """A decode worker: pulls prompt KV, runs the continuous batch, streams tokens."""

    engine: EngineConfig = field(
        default_factory=EngineConfig, metadata=flag(exclude=("role", "kv_lease_seconds"))
    )
    """The engine (DECODE role)."""
    debug_zero_kv_block: int | None = field(default=None, metadata=flag(hidden=True))
    """Test hook: zero this block of every received KV (proves decode uses the pulled KV)."""
    debug_recompute_prompt: bool = field(default=False, metadata=flag(hidden=True))
    """Test hook: recompute every prompt instead of pulling its KV (fires the recompute alert;
    `EngineConfig.debug_recompute_prompt`)."""
    cost_model: str = field(default="auto", metadata=flag(choices=COST_MODEL_MODES))
    """The step cost model that sizes mixed steps: auto (the saved one, else a quick profile
    once at start, well under 60 s), saved (only a saved one), off (none)."""

    role: typing.ClassVar[EngineRole] = EngineRole.DECODE

    def __post_init__(self) -> None:
        super().__post_init__()
        ok = self.cost_model in COST_MODEL_MODES
        checks.check(ok, "cost_model", f"expected one of {COST_MODEL_MODES}", self.cost_model)

    def engine_config(self) -> EngineConfig:
        """DECODE role, with the recompute test hook passed on."""
        return dataclasses.replace(
            super().engine_config(), debug_recompute_prompt=self.debug_recompute_prompt
        )
