"""What the pdserve dashboard shows: its rows, panels and PromQL, as plain data.

`dashboards.py` turns this into Grafana JSON with grafana-foundation-sdk; the observability test
runs every query here against a live Prometheus, and docs/observability.md plots them. Each
panel's `answers` is the question it answers (its Grafana description).

Selectors: request-level metrics come from the router (`role="router"`); worker metrics are
filtered by the `role` and `worker` variables. `$__rate_interval` is Grafana's own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ALL = ".*"  # a label variable's value with "All" selected (its all_value)
TTFT_SLOS = ("0.1", "0.2", "0.5", "1.0", "2.0")  # le values as prometheus-client writes them
TPOT_SLOS = ("0.02", "0.05", "0.1")
DEFAULT_TTFT_SLO, DEFAULT_TPOT_SLO = "0.5", "0.05"
ROUTER = 'role="router", model=~"$model"'
WORKER = 'model=~"$model", role=~"$role", worker=~"$worker"'
RATE = "[$__rate_interval]"


def substitute(
    expr: str,
    rate_interval: str,
    ttft_slo: str = DEFAULT_TTFT_SLO,
    tpot_slo: str = DEFAULT_TPOT_SLO,
) -> str:
    """`expr` (a query or a legend) with the dashboard's variables put in as Grafana would with
    "All" selected for model, role and worker, the SLO choices given, and `rate_interval` for
    Grafana's `$__rate_interval` (what the observability test and the docs' figures run)."""
    values = {
        "$__rate_interval": rate_interval,
        "$model": ALL,
        "$role": ALL,
        "$worker": ALL,
        "$ttft_slo": ttft_slo,
        "$tpot_slo": tpot_slo,
    }
    for name, value in values.items():
        expr = expr.replace(name, value)
    return expr


def slug(title: str) -> str:
    """A row's figure name in docs/observability/ ("TTFT legs" -> "ttft_legs")."""
    return re.sub(r"[^a-z0-9]+", "_", title.lower()).strip("_")


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    answers: str
    queries: tuple[Query, ...]
    stacked: bool = False


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


def _quantiles(metric: str, selector: str = ROUTER, by: str = "") -> tuple[Query, ...]:
    group = f"le{', ' + by if by else ''}"
    legend = f"{{{{{by}}}}} " if by else ""
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by ({group}) "
            f"(rate({metric}_bucket{{{selector}}}{RATE})))",
            f"{legend}p{int(q * 100)}",
        )
        for q in (0.5, 0.9, 0.99)
    )


def _latency(title: str, metric: str, answers: str) -> Panel:
    return Panel(title, "s", answers, _quantiles(metric))


def _attainment(title: str, metric: str, slo: str, answers: str) -> Panel:
    ratio = (
        f'sum(rate({metric}_bucket{{{ROUTER}, le="${slo}"}}{RATE})) / '
        f"sum(rate({metric}_count{{{ROUTER}}}{RATE}))"
    )
    return Panel(title, "percentunit", answers, (Query(ratio, f"<= ${slo} s"),))


def _per_worker(metric: str, legend: str = "{{service}}") -> Query:
    return Query(f"sum by (service) ({metric}{{{WORKER}}})", legend)


ROWS = (
    Row(
        "Latency",
        (
            _latency(
                "TTFT",
                "pdserve_time_to_first_token_seconds",
                "How long do clients wait for their first token (request received to first "
                "token sent, at the router)?",
            ),
            _latency(
                "TPOT",
                "pdserve_time_per_output_token_seconds",
                "How fast does each request's stream run after its first token ((E2E - TTFT) / "
                "(tokens - 1), per request)?",
            ),
            _latency(
                "ITL",
                "pdserve_inter_token_latency_seconds",
                "How long are the gaps between streamed tokens, the stalls a reader sees?",
            ),
            _latency(
                "E2E latency",
                "pdserve_e2e_request_latency_seconds",
                "How long does a whole request take?",
            ),
        ),
    ),
    Row(
        "SLOs and traffic",
        (
            _attainment(
                "TTFT SLO attainment",
                "pdserve_time_to_first_token_seconds",
                "ttft_slo",
                "What share of requests got their first token within the TTFT SLO (the "
                "variable; each value is a histogram bucket boundary, so the share is exact)?",
            ),
            _attainment(
                "TPOT SLO attainment",
                "pdserve_time_per_output_token_seconds",
                "tpot_slo",
                "What share of requests streamed within the TPOT SLO?",
            ),
            Panel(
                "Requests and errors",
                "reqps",
                "How many requests finish per second, by finish reason, how many fail, by "
                "gRPC code (HTTP 4xx/5xx count under the code they map to; refusals included), "
                "and how many streams moved to another worker, by reason (migrations)?",
                (
                    Query(
                        f"sum by (finish_reason) "
                        f"(rate(pdserve_request_success_total{{{ROUTER}}}{RATE}))",
                        "ok: {{finish_reason}}",
                    ),
                    Query(
                        f"sum by (code) (rate(pdserve_request_errors_total{{{ROUTER}}}{RATE}))",
                        "error: {{code}}",
                    ),
                    Query(
                        f"sum by (reason) "
                        f"(rate(pdserve_request_migrations_total{{{ROUTER}}}{RATE}))",
                        "moved: {{reason}}",
                    ),
                ),
            ),
            Panel(
                "Tokens per second",
                "short",
                "How many prompt tokens are admitted and output tokens generated per second?",
                (
                    Query(f"sum(rate(pdserve_prompt_tokens_total{{{ROUTER}}}{RATE}))", "input"),
                    Query(
                        f"sum(rate(pdserve_generation_tokens_total{{{ROUTER}}}{RATE}))", "output"
                    ),
                ),
            ),
            Panel(
                "Serving path",
                "reqps",
                "How many requests are prefilled on the prefill pool (remote) and how many on "
                "their decode worker (local, conditional disaggregation), and why (mode, the "
                "length rule, or the lower predicted TTFT)?",
                (
                    Query(
                        "sum by (path, reason) "
                        f"(rate(pdserve_router_path_decisions_total{{{ROUTER}}}{RATE}))",
                        "{{path}} ({{reason}})",
                    ),
                ),
                stacked=True,
            ),
        ),
    ),
    Row(
        "TTFT legs",
        (
            Panel(
                "Mean seconds per leg",
                "s",
                "Where does a request's time go: router queue, tokenize, prefill queue, prefill "
                "compute, KV transfer, decode queue, first decode step, decode?",
                (
                    Query(
                        f"sum by (leg) (rate(pdserve_request_leg_seconds_sum{{{ROUTER}}}{RATE})) "
                        f"/ sum by (leg) "
                        f"(rate(pdserve_request_leg_seconds_count{{{ROUTER}}}{RATE}))",
                        "{{leg}}",
                    ),
                ),
                stacked=True,
            ),
            Panel(
                "p99 per leg",
                "s",
                "Which leg makes the slowest requests slow?",
                (
                    Query(
                        f"histogram_quantile(0.99, sum by (le, leg) "
                        f"(rate(pdserve_request_leg_seconds_bucket{{{ROUTER}}}{RATE})))",
                        "{{leg}}",
                    ),
                ),
            ),
        ),
    ),
    Row(
        "Workers",
        (
            Panel(
                "Running and waiting requests",
                "short",
                "How full is each worker's batch, and how many requests wait for a slot or blocks?",
                (
                    _per_worker("pdserve_num_requests_running", "{{service}} running"),
                    _per_worker("pdserve_num_requests_waiting", "{{service}} waiting"),
                ),
            ),
            Panel(
                "KV cache usage",
                "percentunit",
                "How much of each worker's KV cache is in use (the alert fires over 90%)?",
                (_per_worker("pdserve_kv_cache_usage_ratio"),),
            ),
            Panel(
                "Free and pinned KV blocks",
                "short",
                "How many blocks can each worker still allocate, and how many does a prefill "
                "worker hold pinned for decode workers to pull?",
                (
                    _per_worker("pdserve_kv_blocks_free", "{{service}} free"),
                    _per_worker("pdserve_kv_blocks_pinned", "{{service}} pinned"),
                ),
            ),
            Panel(
                "Prefix-cache hit rate",
                "percentunit",
                "What share of looked-up prompt tokens did each worker's prefix cache hold?",
                (
                    Query(
                        f"sum by (service) (rate(pdserve_prefix_cache_hits_total{{{WORKER}}}"
                        f"{RATE})) / sum by (service) "
                        f"(rate(pdserve_prefix_cache_queries_total{{{WORKER}}}{RATE}))",
                        "{{service}}",
                    ),
                ),
            ),
            Panel(
                "Preemptions",
                "short",
                "How often does a worker run out of blocks and recompute a request?",
                (
                    Query(
                        f"sum by (service) (rate(pdserve_num_preemptions_total{{{WORKER}}}{RATE}))",
                        "{{service}}",
                    ),
                ),
            ),
            Panel(
                "Mixed-step token budget",
                "short",
                "How many prompt tokens may a step beside running streams compute (the per-step "
                "token budget, median and p10 per worker), and how much longer than predicted "
                "do those steps run here (the budget's live ratio)?",
                (
                    Query(
                        "histogram_quantile(0.5, sum by (le, service) "
                        f"(rate(pdserve_step_prefill_budget_tokens_bucket{{{WORKER}}}{RATE})))",
                        "{{service}} p50 tokens",
                    ),
                    Query(
                        "histogram_quantile(0.1, sum by (le, service) "
                        f"(rate(pdserve_step_prefill_budget_tokens_bucket{{{WORKER}}}{RATE})))",
                        "{{service}} p10 tokens",
                    ),
                    _per_worker("pdserve_step_time_scale_ratio", "{{service}} live ratio"),
                ),
            ),
            Panel(
                "Cores held and lent",
                "short",
                "On how many CPUs does each worker compute now (core lending: its own it has not "
                "lent, plus borrowed ones), and what share of the time are its own lent?",
                (
                    _per_worker("pdserve_cores_held", "{{service}} held"),
                    Query(
                        f"sum by (service) (rate(pdserve_core_lent_seconds_total{{{WORKER}}}"
                        f"{RATE}))",
                        "{{service}} lent share",
                    ),
                ),
            ),
            Panel(
                "Health",
                "short",
                "Is every service scraped (up), and does the router route to each worker "
                "(its health checks)?",
                (
                    Query(
                        'min by (service) (up{job="pdserve", model=~"$model"})', "{{service}} up"
                    ),
                    Query(
                        f"min by (worker) (pdserve_worker_healthy{{{ROUTER}}})",
                        "{{worker}} healthy",
                    ),
                ),
            ),
        ),
    ),
    Row(
        "KV transfer",
        (
            Panel(
                "KV bytes per second",
                "Bps",
                "How many KV bytes do decode workers pull, by backend?",
                (
                    Query(
                        f"sum by (service, backend) (rate(pdserve_kv_transfer_bytes_total"
                        f'{{model=~"$model", role="decode", worker=~"$worker"}}{RATE}))',
                        "{{service}} {{backend}}",
                    ),
                ),
            ),
            Panel(
                "KV transfer seconds",
                "s",
                "How long does pulling one request's prompt KV take (measured by decode workers)?",
                _quantiles(
                    "pdserve_kv_transfer_seconds",
                    'model=~"$model", role="decode", worker=~"$worker"',
                ),
            ),
            Panel(
                "KV transfer failures",
                "short",
                "Which transfers fail, where, and why (unavailable, deadline_exceeded, "
                "not_found, handshake, lease_expired, kv_timeout)?",
                (
                    Query(
                        f"sum by (role, reason) (increase(pdserve_kv_transfer_failures_total"
                        f"{{{WORKER}}}{RATE}))",
                        "{{role}} {{reason}}",
                    ),
                ),
            ),
            Panel(
                "Prompt tokens computed on decode workers",
                "short",
                "Is the cluster quietly not P/D? Prompt positions decode workers ran, by "
                "cause: local_prefill and preemption are expected; fallback (remote KV that "
                "was recomputed) fires an alert.",
                (
                    Query(
                        f"sum by (cause) (rate(pdserve_decode_recomputed_prompt_tokens_total"
                        f'{{model=~"$model", role="decode", worker=~"$worker"}}{RATE}))',
                        "{{cause}}",
                    ),
                ),
                stacked=True,
            ),
        ),
    ),
)
