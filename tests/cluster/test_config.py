"""ClusterConfig's children: workers bind `worker_host` (loopback unless told), never the
router's --host; per-service settings reach each child."""

from __future__ import annotations

import os

import pytest

from services.cluster.config import ClusterConfig
from services.config.roles import DecodeConfig, PrefillConfig, RouterConfig


def _hosts(cluster: ClusterConfig) -> tuple[str, str, str]:
    router = cluster.router_config(["127.0.0.1:1"], ["127.0.0.1:2"])
    return router.host, cluster.prefill_config(0).host, cluster.decode_config(0).host


def test_workers_bind_loopback_whatever_the_router_binds():
    assert _hosts(ClusterConfig()) == ("127.0.0.1",) * 3
    public = ClusterConfig(router=RouterConfig(host="0.0.0.0"))
    assert _hosts(public) == ("0.0.0.0", "127.0.0.1", "127.0.0.1")


def test_workers_leave_loopback_only_when_told():
    told = ClusterConfig(router=RouterConfig(host="0.0.0.0"), worker_host="10.1.2.3")
    assert _hosts(told) == ("0.0.0.0", "10.1.2.3", "10.1.2.3")
    with pytest.raises(ValueError, match="^worker_host: must be a host name or address"):
        ClusterConfig(worker_host="")
    with pytest.raises(ValueError, match=r"^prefill\.host: set by the cluster \(worker_host"):
        ClusterConfig(prefill=PrefillConfig(host="0.0.0.0"))


def test_each_service_gets_its_own_bound_on_concurrent_calls():
    cluster = ClusterConfig(
        router=RouterConfig(max_concurrent_rpcs=10),
        prefill=PrefillConfig(max_concurrent_rpcs=20),
        decode=DecodeConfig(max_concurrent_rpcs=30),
    )
    router = cluster.router_config([], [])
    assert (router.max_concurrent_rpcs, cluster.prefill_config(0).max_concurrent_rpcs) == (10, 20)
    assert cluster.decode_config(0).max_concurrent_rpcs == 30
    assert ClusterConfig().decode_config(0).max_concurrent_rpcs is None  # the server's default
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="^max_concurrent_rpcs: must be an integer >= 1"):
            DecodeConfig(max_concurrent_rpcs=bad)


def test_workers_of_a_cpu_plan_share_a_core_ledger_unless_told_not_to():
    from services.cluster.launcher import cluster_spec
    from services.cluster.placement import plan_placement

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    plan = plan_placement(cpus[:2], 1, 1)
    spec = cluster_spec(ClusterConfig(), plan)
    assert spec.core_ledger and spec.core_ledger.startswith("/dev/shm/pdserve-cores-")
    assert spec.home_cpus == {"prefill-0": [cpus[0]], "decode-0": [cpus[1]]}
    assert {w.config.core_ledger for w in spec.workers} == {spec.core_ledger}
    lines = spec.prepare()
    try:
        from services.worker.core_ledger import CoreLedger

        assert CoreLedger.cpus_of(spec.core_ledger) == cpus[:2]
        assert any("core lending" in line for line in lines)
    finally:
        spec.clean_up()
    assert not os.path.exists(spec.core_ledger)
    for config, why in (
        (ClusterConfig(core_lending=False), "--no-core-lending"),
        (ClusterConfig(router=RouterConfig(disaggregation="always")), "the fixed split"),
        (ClusterConfig(decode=DecodeConfig(cpus=str(cpus[1]))), "a pool pinned by hand"),
    ):
        assert cluster_spec(config, plan).core_ledger is None, why
    assert not ClusterConfig().lends_cores(plan_placement(cpus[:1], 1, 1))  # shared CPUs
    assert not ClusterConfig().lends_cores(None)  # --placement none
    with pytest.raises(ValueError, match="core_lending"):
        ClusterConfig(core_lending="yes")


def test_serve_logs_its_serving_path_rule():
    """The router decides each prompt's path itself (`serving_path.py`): serve passes
    --max-local-prefill-tokens through and logs the rule it runs."""
    from services.cluster.launcher import cluster_spec
    from services.cluster.placement import plan_placement

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    plan = plan_placement(cpus[:2], 1, 1)
    assert ClusterConfig().router_config([], [], plan).max_local_prefill_tokens is None
    given = ClusterConfig(router=RouterConfig(max_local_prefill_tokens=64))
    assert given.router_config([], [], plan).max_local_prefill_tokens == 64
    for config, expected in (
        (ClusterConfig(), "each prompt where its predicted TTFT is lower"),
        (given, "prompts of at most 64 tokens prefilled on their decode worker"),
        (ClusterConfig(core_lending=False), "every prompt prefilled on the prefill pool"),
        (ClusterConfig(router=RouterConfig(disaggregation="never")), "--disaggregation never"),
    ):
        spec = cluster_spec(config, plan)
        try:
            logged = " ".join(spec.prepare())
        finally:
            spec.clean_up()
        assert expected in logged, (config, logged)
