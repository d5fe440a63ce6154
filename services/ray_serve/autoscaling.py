"""Autoscaling pdserve's worker deployments on their engines' load.

Requests reach pdserve's workers over its own gRPC, not through Serve's handles, so Serve's
default policy (ongoing requests counted at the handles) would always see 0. Each worker replica
instead reports its engine's running + waiting requests (`record_autoscaling_stats`), and this
policy asks for enough replicas that each holds `target_ongoing_requests` of them, as Serve's
default policy does with its own count. Serve applies min/max_replicas, the up/downscaling
factors and delays on top (it wraps every custom policy). `build_app` names this policy for a
worker deployment whose `autoscaling_config` names none.
"""

from __future__ import annotations

from typing import Any

POLICY = "services.ray_serve.autoscaling:engine_load_policy"
METRIC = "num_requests"


def engine_load_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """(desired replicas, policy state) for a Serve `AutoscalingContext`: the replicas'
    reported requests (averaged over Serve's look-back window) over target_ongoing_requests;
    the current target while no replica has reported yet."""
    per_replica = (ctx.aggregated_metrics or {}).get(METRIC) or {}
    if not per_replica or ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    total = sum(per_replica.values())
    return total / ctx.config.get_target_ongoing_requests(), {}
