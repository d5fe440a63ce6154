"""A worker's engine figures as Prometheus series (`services/common/metrics.py`), published by
its engine thread between steps: KV blocks and bytes, requests running and waiting, the step
budget's live ratio, and the engine's counters (preemptions, prefix-cache queries and hits,
recomputed prompt tokens) as increments since the last publish."""

from __future__ import annotations

from services.common import metrics
from services.engine import Engine
from services.engine.scheduler import RECOMPUTE_CAUSES

COUNTERS = ("preemptions", "queries", "hits", *RECOMPUTE_CAUSES)


def publish_worker_metrics(
    engine: Engine, role: str, last_counts: dict[str, int]
) -> dict[str, int]:
    """Set the gauges and add what each counter gained since `last_counts` (the totals the
    previous call returned; zeros at first); returns the totals now."""
    pool = engine.kv_cache.pool
    metrics.KV_BLOCKS_FREE.labels(role).set(pool.num_free_blocks)
    pinned = engine.num_pinned_blocks
    block_bytes = engine.kv_cache.spec.bytes_per_block
    metrics.KV_BLOCKS_PINNED.labels(role).set(pinned)
    metrics.KV_CACHE_BYTES.labels(role, "free").set(pool.num_free_blocks * block_bytes)
    metrics.KV_CACHE_BYTES.labels(role, "used").set((pool.num_used_blocks - pinned) * block_bytes)
    metrics.KV_CACHE_BYTES.labels(role, "pinned").set(pinned * block_bytes)
    metrics.KV_CACHE_USAGE.labels(role).set(pool.num_used_blocks / pool.num_blocks)
    metrics.NUM_REQUESTS_RUNNING.labels(role).set(engine.scheduler.num_running)
    metrics.NUM_REQUESTS_WAITING.labels(role).set(engine.num_waiting)
    scheduler = engine.scheduler
    if scheduler.step_budget is not None:
        threads = scheduler.step_budget.cost.threads
        metrics.STEP_TIME_SCALE.labels(role).set(scheduler.live_scale.ratio(threads))
    totals = {
        "preemptions": scheduler.num_preemptions,
        "queries": scheduler.prefix_cache_queries,
        "hits": scheduler.prefix_cache_hits,
        **scheduler.prompt_tokens_computed_by_cause,
    }
    for name, counter in (
        ("preemptions", metrics.NUM_PREEMPTIONS),
        ("queries", metrics.PREFIX_CACHE_QUERIES),
        ("hits", metrics.PREFIX_CACHE_HITS),
    ):
        counter.labels(role).inc(totals[name] - last_counts[name])
    if role == "decode":  # prompt positions a decode worker ran, by why it had to
        for cause in RECOMPUTE_CAUSES:
            metrics.DECODE_RECOMPUTED_PROMPT_TOKENS.labels(role, cause).inc(
                totals[cause] - last_counts[cause]
            )
    return totals
