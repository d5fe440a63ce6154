"""How `pdserve serve` divides this machine's CPUs (or GPUs) between the router and the pools."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from services.worker.cpus import format_cpus


@dataclass(frozen=True)
class PlacementPlan:
    """Which CPUs (and GPU) each process of a `pdserve serve` cluster gets. Each worker runs
    one torch thread per CPU it is given; `router` may share the prefill workers' CPUs."""

    router: tuple[int, ...]
    prefill: tuple[tuple[int, ...], ...]
    decode: tuple[tuple[int, ...], ...]
    prefill_gpus: tuple[int, ...] = ()
    decode_gpus: tuple[int, ...] = ()
    shared: bool = False
    """Fewer CPUs than workers: workers share CPUs (the plan says so in its log line)."""

    def describe(self) -> str:
        """One log line: "placement: router cpu 0; prefill-0 cpu 0 (1 thread); ..."."""
        parts = [f"router cpus {format_cpus(self.router)}"]
        for role, pool, gpus in (
            ("prefill", self.prefill, self.prefill_gpus),
            ("decode", self.decode, self.decode_gpus),
        ):
            for i, cpus in enumerate(pool):
                gpu = f", gpu {gpus[i]}" if gpus else ""
                threads = f"{len(cpus)} thread{'s' if len(cpus) > 1 else ''}"
                parts.append(f"{role}-{i} cpus {format_cpus(cpus)} ({threads}{gpu})")
        note = " (SHARED: fewer CPUs than workers)" if self.shared else ""
        return "placement: " + "; ".join(parts) + note


def plan_placement(
    cpus: Sequence[int], num_prefill: int, num_decode: int, gpus: Sequence[int] = ()
) -> PlacementPlan:
    """Divide `cpus` so that no CPU serves two workers. The router gets one CPU of its own when
    there are at least two more CPUs than workers; else it shares the prefill workers' CPUs
    (prefill runs in bursts, while every decode step is on some stream's critical path), or the
    decode workers' when there is no prefill worker. The rest is split evenly in contiguous
    ranges, CPUs left over going to prefill workers first (prefill is compute-bound; decode at
    small batches reads weights and KV). With fewer CPUs than workers each worker gets one CPU
    round-robin and `shared` is set. With `gpus` (CUDA devices), each worker gets one of its
    own. Raises ValueError when there are fewer GPUs than workers or no decode worker."""
    cpus = sorted(cpus)
    workers = num_prefill + num_decode
    if num_decode < 1 or num_prefill < 0:
        raise ValueError(f"placement: needs a decode worker, got {num_prefill}P + {num_decode}D")
    if gpus and len(gpus) < workers:
        raise ValueError(
            f"placement: {workers} workers need one GPU each, {len(gpus)} visible "
            f"({format_cpus(gpus)}); use fewer --num-prefill/--num-decode"
        )
    gpu_ids = tuple(gpus[:workers]) if gpus else ()
    shared = len(cpus) < workers
    own_router = len(cpus) >= workers + 2
    pools: list[tuple[int, ...]] = []
    if shared:
        pools = [(cpus[i % len(cpus)],) for i in range(workers)]
    else:
        rest = cpus[1:] if own_router else cpus
        base, extra = divmod(len(rest), workers)
        bounds = [i * base + min(i, extra) for i in range(workers + 1)]  # extras go first
        pools = [tuple(rest[bounds[i] : bounds[i + 1]]) for i in range(workers)]
    sharing = pools[:num_prefill] or pools  # no prefill worker (colocated): the decode CPUs
    router = (cpus[0],) if own_router else tuple(sorted({c for p in sharing for c in p}))
    return PlacementPlan(
        router, tuple(pools[:num_prefill]), tuple(pools[num_prefill:]),
        gpu_ids[:num_prefill], gpu_ids[num_prefill:], shared,
    )  # fmt: skip


def visible_gpus(environ: Mapping[str, str]) -> list[int]:
    """CUDA devices this machine shows without importing torch: $CUDA_VISIBLE_DEVICES when set
    (numeric ids), else the NVIDIA driver's /proc entries (none on a CPU machine)."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [int(x) for x in visible.split(",") if x.strip().isdigit()]
    root = Path("/proc/driver/nvidia/gpus")
    return list(range(len(list(root.iterdir())))) if root.is_dir() else []
