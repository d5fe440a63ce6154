"""CPU placement: parsing `--cpus`, pinning a worker, and `pdserve serve`'s plan that gives every
worker CPUs of its own (threads to match) and, on CUDA, one GPU each."""

from __future__ import annotations

import os

import pytest

from services.cli import main as cli
from services.cluster import launcher
from services.cluster.placement import PlacementPlan, plan_placement
from services.worker import cpus as worker_cpus
from services.worker.cpus import format_cpus, parse_cpu_list


def test_parse_cpu_list():
    allowed = sorted(os.sched_getaffinity(0))
    first = allowed[0]
    assert parse_cpu_list(str(first)) == [first]
    assert parse_cpu_list(f"{first}-{first}") == [first]
    if len(allowed) >= 2 and allowed[1] == first + 1:
        assert parse_cpu_list(f"{first},{first + 1}") == [first, first + 1]
        assert parse_cpu_list(f"{first}-{first + 1}") == [first, first + 1]
        assert parse_cpu_list(f" {first + 1} , {first}") == [first, first + 1]


@pytest.mark.parametrize("text", ["", "a", "0,,1", "1-0", "-1", "0-", "0:1", "99999"])
def test_parse_cpu_list_rejects_bad_input(text):
    with pytest.raises(ValueError, match=r"^--cpus: "):
        parse_cpu_list(text)


def test_apply_cpu_placement():
    """It returns the engine thread's count (given, else one per pinned or allowed CPU) and
    leaves torch's process-wide default at 1 (services/engine/threads.py)."""
    import torch

    allowed, num_threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        assert worker_cpus.apply_cpu_placement(None, None) == len(allowed)
        assert torch.get_num_threads() == 1
        cpus = ",".join(str(c) for c in sorted(allowed))
        assert worker_cpus.apply_cpu_placement(None, cpus) == len(allowed)
        assert os.sched_getaffinity(0) == allowed
        first = min(allowed)
        assert worker_cpus.apply_cpu_placement(None, str(first)) == 1
        assert os.sched_getaffinity(0) == {first}
        os.sched_setaffinity(0, allowed)
        assert worker_cpus.apply_cpu_placement(3, None) == 3
        with pytest.raises(ValueError, match=r"^--threads: "):
            worker_cpus.apply_cpu_placement(0, None)
        with pytest.raises(ValueError, match=r"^--cpus: "):
            worker_cpus.apply_cpu_placement(None, "0-x")
    finally:
        os.sched_setaffinity(0, allowed)
        torch.set_num_threads(num_threads)


@pytest.mark.parametrize(
    ("cpus", "text"), [([0, 1, 2, 5, 6, 9], "0-2,5-6,9"), ([3], "3"), ([4, 1], "1,4")]
)
def test_format_cpus_is_what_parse_reads(cpus, text):
    assert format_cpus(cpus) == text
    expanded = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        expanded += range(int(low), int(high or low) + 1)
    assert expanded == sorted(cpus)


def _config(argv: tuple[str, ...]):
    return cli.service_config(cli._parser().parse_args(list(argv)))


def _check_plan(plan: PlacementPlan, cpus: list[int], num_prefill: int, num_decode: int) -> None:
    workers = [*plan.prefill, *plan.decode]
    assert (len(plan.prefill), len(plan.decode)) == (num_prefill, num_decode)
    used = [c for w in workers for c in w]
    assert len(used) == len(set(used)), f"a CPU serves two workers: {plan}"
    assert all(workers) and set(used) <= set(cpus)
    sizes = [len(w) for w in workers]
    assert max(sizes) - min(sizes) <= 1  # an even split
    assert set(used) | set(plan.router) == set(cpus)  # no CPU left idle
    if len(cpus) >= len(workers) + 2:
        assert len(plan.router) == 1 and not set(plan.router) & set(used)
    else:  # it shares the prefill workers' CPUs (the decode workers' when colocated)
        assert set(plan.router) == {c for w in plan.prefill or plan.decode for c in w}
    line = plan.describe()
    for i, w in enumerate(plan.decode):  # the log line says each worker's CPUs and threads
        assert f"decode-{i} cpus {format_cpus(w)} ({len(w)} thread" in line


@pytest.mark.parametrize("num_cpus", [2, 4, 8, 64])
@pytest.mark.parametrize("pools", [(1, 1), (1, 2), (2, 1), (2, 2), (3, 5), (0, 1), (0, 3)])
def test_no_cpu_serves_two_workers(num_cpus, pools):
    """The plan's properties for 2, 4, 8 and 64 CPUs (offset ids, as a cgroup may give)."""
    cpus = list(range(8, 8 + num_cpus))
    if num_cpus < sum(pools):
        plan = plan_placement(cpus, *pools)
        assert plan.shared and "SHARED" in plan.describe()
        return
    plan = plan_placement(cpus, *pools)
    assert not plan.shared
    _check_plan(plan, cpus, *pools)


def test_the_two_cpu_plan():
    """What the README says for this machine's kind: prefill and the router on CPU 0, decode
    alone on CPU 1, one thread each."""
    plan = plan_placement([0, 1], 1, 1)
    assert (plan.router, plan.prefill, plan.decode) == ((0,), ((0,),), ((1,),))


def test_one_gpu_per_worker():
    plan = plan_placement(range(8), 1, 2, gpus=[0, 1, 2, 3])
    assert (plan.prefill_gpus, plan.decode_gpus) == ((0,), (1, 2))
    with pytest.raises(ValueError, match=r"^placement: 3 workers need one GPU each, 2 visible"):
        plan_placement(range(8), 1, 2, gpus=[0, 1])


def test_serve_applies_the_plan_and_a_pool_setting_wins():
    """Each worker's config carries its plan's CPUs (threads follow them), the router its own;
    a pool's --*-cpus wins; --placement none pins nothing. (Config values are checked against
    this machine's CPUs, so the plan is over those.)"""
    allowed = sorted(os.sched_getaffinity(0))
    config = _config(("serve",))
    plan = launcher.placement_plan(config)
    assert plan == plan_placement(allowed, 1, 1)
    spec = launcher.cluster_spec(config, plan)
    prefill, decode = (w.config for w in spec.workers)
    assert (prefill.cpus, decode.cpus) == (
        format_cpus(plan.prefill[0]),
        format_cpus(plan.decode[0]),
    )
    assert prefill.threads is None and decode.threads is None  # one thread per CPU, at start
    assert spec.router(["a:1"], ["b:2"]).config.cpus == format_cpus(plan.router)
    assert spec.plan_line == plan.describe()
    pinned = _config(("serve", "--decode-cpus", str(allowed[0])))
    workers = launcher.cluster_spec(pinned, plan).workers
    assert workers[1].config.cpus == str(allowed[0])  # --decode-cpus wins over the plan
    none = _config(("serve", "--placement", "none"))
    assert launcher.placement_plan(none) is None
    unpinned = launcher.cluster_spec(none, None)
    assert all(w.config.cpus is None for w in unpinned.workers)
    assert unpinned.router(["a:1"], ["b:2"]).config.cpus is None


def test_serve_gives_each_cuda_worker_its_gpu():
    allowed = sorted(os.sched_getaffinity(0))
    config = _config(("serve", "--device", "cuda"))
    plan = launcher.placement_plan(config, allowed, {"CUDA_VISIBLE_DEVICES": "4,6"})
    spec = launcher.cluster_spec(config, plan)
    assert [w.env.get("CUDA_VISIBLE_DEVICES") for w in spec.workers] == ["4", "6"]
    with pytest.raises(ValueError, match="2 workers need one GPU each, 1 visible"):
        launcher.placement_plan(config, allowed, {"CUDA_VISIBLE_DEVICES": "0"})
    cpu = _config(("serve",))
    cpu_plan = launcher.placement_plan(cpu, allowed, {"CUDA_VISIBLE_DEVICES": "0"})
    workers = launcher.cluster_spec(cpu, cpu_plan).workers
    assert all("CUDA_VISIBLE_DEVICES" not in w.env for w in workers)
