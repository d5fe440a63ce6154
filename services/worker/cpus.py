"""CPU placement of one worker process: affinity (`--cpus`) and torch threads (`--threads`).

Prefill is compute-bound and decode memory-bound; pinning each pool to its own cores keeps one
from stealing the other's. The worker commands call `apply_cpu_placement` before they build their
engine; `pdserve serve` divides the machine with `services.cluster.placement.plan_placement`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


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


def apply_cpu_placement(threads: int | None, cpus: str | None) -> int:
    """Pin this process to `cpus` and settle its engine's torch threads; returns that count.

    `threads` defaults to the number of CPUs given (one thread per pinned CPU avoids
    oversubscription), else to every CPU this process may use. torch's process-wide default
    becomes 1: only the engine thread runs multi-threaded (`EngineLoop` gives it the count;
    `services/engine/threads.py` says why). Call it before building the engine. Raises
    ValueError naming --threads or --cpus; nothing is changed then.
    """
    if threads is not None and threads < 1:
        raise ValueError(f"--threads: must be >= 1, got {threads}")
    cpu_ids = pin_cpus(cpus)
    threads = threads or len(cpu_ids or os.sched_getaffinity(0))
    import torch  # after the affinity change: OpenMP reads it when torch starts

    torch.set_num_threads(1)
    return threads


def worker_cpus(config: object) -> list[int] | None:
    """A worker config's `cpus` as ids (None when it sets none): its engine thread pins one
    torch thread per CPU of it."""
    cpus = getattr(config, "cpus", None)
    return parse_cpu_list(cpus) if cpus else None


def format_cpus(cpus: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (what `parse_cpu_list` reads back)."""
    parts: list[str] = []
    for cpu in sorted(cpus):
        if parts and parts[-1].rpartition("-")[2] == str(cpu - 1):
            parts[-1] = f"{parts[-1].partition('-')[0]}-{cpu}"
        else:
            parts.append(str(cpu))
    return ",".join(parts)
