"""The intra-op (OpenMP) threads of the one OS thread that runs the engine's steps.

libgomp gives every OS thread that opens a parallel region a team of its own, and once it
manages more threads than the process has CPUs it stops spin-waiting between regions: every
region's workers then sleep and are woken through futexes. A worker whose main thread built the
engine with N threads and whose engine thread then stepped it with N more ran 2N threads on N
CPUs, and its decode steps took 15-20% longer than the same steps in a process where one thread
did both (SmolLM2-135M, float32, 2 threads: 38-40 ms against 32-34 ms, AMD EPYC, 2026-12-05).

So a worker process keeps torch's process-wide default at 1 (every other thread, the model load
included, runs torch single-threaded and opens no team) and gives its engine thread N threads
with `set_thread_threads`: `omp_set_num_threads` is a per-thread setting, so this changes the
calling thread only. vLLM's CPU worker likewise binds one OpenMP team to its cores.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from services.engine.kernels import load_cpu_kernels

logger = logging.getLogger(__name__)


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The GNU OpenMP runtime torch loaded (None: another runtime, or none)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1]
        if "libgomp" in Path(path).name:
            return ctypes.CDLL(path)
    return None


def set_thread_threads(num_threads: int) -> None:
    """Run the calling thread's torch ops on `num_threads` OpenMP threads, leaving every other
    thread's setting and torch's process-wide default alone. Without libgomp (another OpenMP
    runtime) this falls back to `torch.set_num_threads`, which changes the default too.
    Raises ValueError for a count below 1."""
    if num_threads < 1:
        raise ValueError(f"threads: must be >= 1, got {num_threads}")
    torch.get_num_threads()  # torch's lazy per-thread init runs first: it would undo ours
    gomp = _libgomp()
    if gomp is None:
        torch.set_num_threads(num_threads)
        return
    gomp.omp_set_num_threads(ctypes.c_int(num_threads))


def pin_thread_team(cpu_ids: Sequence[int]) -> list[int] | None:
    """Run the calling thread's torch ops on one OpenMP thread per CPU of `cpu_ids`, member i
    bound to `cpu_ids[i]` (the caller is member 0), so no two of them ever share a CPU; returns
    their Linux thread ids. Without the C++ extension (no compiler), only the count is set and
    None is returned. Raises ValueError for an empty list or a CPU this process may not use."""
    cpus = [int(c) for c in cpu_ids]
    allowed = os.sched_getaffinity(os.getpid())  # the process's (main thread's), not ours
    if not cpus or len(set(cpus)) != len(cpus) or not set(cpus) <= allowed:
        raise ValueError(f"cpus: need distinct CPUs of {sorted(allowed)}, got {cpus}")
    set_thread_threads(len(cpus))
    kernels = load_cpu_kernels()
    if kernels is None:
        return None
    return list(kernels.pin_omp_threads(cpus))


@functools.cache
def _prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PR_SET_NAME = 15  # <linux/prctl.h>


def name_thread(name: str) -> None:
    """Set the calling thread's Linux name (`/proc/self/task/TID/comm`, at most 15 bytes; what
    `top -H` shows). Threads it creates later, its OpenMP team among them, start with it. A
    no-op where prctl is missing."""
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


@contextmanager
def carrying_name(name: str, after: str) -> Iterator[None]:
    """The calling thread is named `name` meanwhile, then `after`. Threads it starts meanwhile
    start with `name`: its OpenMP team keeps it (what a /proc sampler tells compute threads by);
    Python threads take their own once `name_python_threads` ran."""
    name_thread(name)
    try:
        yield
    finally:
        name_thread(after)


def _name_on_start(frame: object, event: str, arg: object) -> None:
    """A profile hook that runs once, first thing in a new Python thread: it takes the
    thread's Python name as its Linux name, then removes itself."""
    sys.setprofile(None)
    name_thread(threading.current_thread().name)


def name_python_threads() -> None:
    """From now on every Python thread of this process names itself after its Python name as
    it starts (`threading.setprofile`; Python 3.14 does this itself), instead of inheriting
    its starter's Linux name: a gRPC channel thread an engine step starts is not compute."""
    threading.setprofile(_name_on_start)


def thread_threads() -> int:
    """The calling thread's OpenMP thread count (what its parallel ops use)."""
    return torch.get_num_threads()
