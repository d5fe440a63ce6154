"""CPU placement of one worker process: affinity (`--cpus`) and torch threads (`--threads`).

Prefill is compute-bound and decode memory-bound; pinning each pool to its own cores keeps one
from stealing the other's (ARCHITECTURE.md). The worker commands call `apply_cpu_placement`
before they build their engine; `pdserve serve` divides the machine with `plan_placement`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


def parse_cpu_list(text: str, flag: str = "--cpus") -> list[int]:
    """ "0,2-3" -> [0, 2, 3], checked against the CPUs this process may use.

    Raises ValueError naming `flag` for bad syntax, an empty list or an unavailable CPU.
    """
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, dash, high = part.strip().partition("-")
            first, last = int(low), int(high) if dash else int(low)
            if first < 0 or last < first:
                raise ValueError
            cpus.update(range(first, last + 1))
    except ValueError:
        raise ValueError(f"{flag}: expected CPU ids like 0,1 or 0-3, got {text!r}") from None
    allowed = os.sched_getaffinity(0)
    if missing := sorted(cpus - allowed):
        raise ValueError(
            f"{flag}: CPU {missing[0]} is not available (allowed: {format_cpus(sorted(allowed))})"
        )
    return sorted(cpus)


def pin_cpus(cpus: str | None) -> list[int] | None:
    """Pin this process to `cpus` (None: leave it); returns the CPU ids. Imports no torch (the
    router calls it). Raises ValueError naming --cpus."""
    if cpus is None:
        return None
    cpu_ids = parse_cpu_list(cpus)
    os.sched_setaffinity(0, cpu_ids)
    return cpu_ids


def apply_cpu_placement(threads: int | None, cpus: str | None) -> list[int] | None:
    """Pin this process to `cpus` and set torch's intra-op threads; returns the CPU ids or None.

    `threads` defaults to the number of CPUs given (one thread per pinned CPU avoids
    oversubscription), else torch's own default is left alone. Call it before building the
    engine. Raises ValueError naming --threads or --cpus; nothing is changed then.
    """
    if threads is not None and threads < 1:
        raise ValueError(f"--threads: must be >= 1, got {threads}")
    cpu_ids = pin_cpus(cpus)
    if cpu_ids is not None:
        threads = threads or len(cpu_ids)
    if threads is not None:
        import torch  # after the affinity change: OpenMP reads it when torch starts

        torch.set_num_threads(threads)
    return cpu_ids


def format_cpus(cpus: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (what `parse_cpu_list` reads back)."""
    parts: list[str] = []
    for cpu in sorted(cpus):
        if parts and parts[-1].rpartition("-")[2] == str(cpu - 1):
            parts[-1] = f"{parts[-1].partition('-')[0]}-{cpu}"
        else:
            parts.append(str(cpu))
    return ",".join(parts)


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
