"""C++ kernels built on first use: CPU paged decode attention, fused layer ops, OpenMP pins."""

# Built with torch's extension builder (a C++ compiler and ninja; about 50 s on 2 cores) into
# `$PDSERVE_CACHE_DIR/kernels/<hash>`, keyed by the source, torch's version and this CPU, so later
# processes load it in well under a second. Where it cannot be built, `load_cpu_kernels()`
# returns None and attention and the layer ops fall back to the pure-torch path.

from __future__ import annotations

import functools
import hashlib
import logging
import platform
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from services.cpu import cpu_info
from services.env import cache_dir

logger = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).with_name(n)
    for n in ("bindings.cpp", "paged_attention.cpp", "fused_ops.cpp", "threads.cpp")
]
_HEADERS = [Path(__file__).with_name("exp_math.h")]  # part of the build's cache key
# -fopenmp: at::parallel_for is a header template that expands to `omp parallel` in this file,
# and the `omp simd` pragmas vectorise the float reductions. The runtime it links, libgomp.so.1,
# is the one torch has already loaded (same soname), so both share one thread pool.
# -fno-trapping-math: GCC vectorises no loop that converts float to int or rounds (the
# polynomial exps of the softmax and SiLU) while floating-point exceptions may trap; pdserve
# never enables traps, and the flag changes no result.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"]


def _cpu_flags() -> str:
    return cpu_info().get("flags") or platform.processor()


def _build_dir() -> Path:
    key = hashlib.sha256()
    for part in (
        *(source.read_bytes() for source in (*_SOURCES, *_HEADERS)),
        torch.__version__.encode(),
        torch.__file__.encode(),  # each environment's own headers and libraries: its own build
        sys.version.encode(),
        platform.machine().encode(),
        _cpu_flags().encode(),
        " ".join(_CFLAGS).encode(),
    ):
        key.update(part)
    path = cache_dir() / "kernels" / f"cpu_kernels-{key.hexdigest()[:16]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


# torch's builder serialises builds with a lock file and waits for it without a timeout; one left
# by a build that was killed (Ctrl-C on a first start) would make every later start wait forever.
STALE_LOCK_S = 300.0


def _clear_stale_lock(lock: Path) -> None:
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        logger.warning("removing a stale kernel build lock (%.0f s old): %s", age, lock)
        lock.unlink(missing_ok=True)


@functools.cache
def load_cpu_kernels() -> ModuleType | None:
    """The compiled extension (`paged_decode_attention(out, q, k_cache, v_cache, block_tables,
    context_lens, scale)`, `rms_norm`, `fused_add_rms_norm`, `silu_and_mul`,
    `rotary_embedding` (fused_ops.cpp gives their shapes), `pin_omp_threads(cpu_ids) -> thread
    ids`), or None where it cannot be built (the reason is logged once)."""
    from torch.utils import cpp_extension  # heavy import, only when a CPU engine starts

    build_dir = _build_dir()
    _clear_stale_lock(build_dir / "lock")
    if not any(build_dir.glob("*.so")):
        print(
            f"pdserve: compiling the CPU kernels once (about 40 s) into {build_dir}",
            file=sys.stderr,
            flush=True,
        )
    try:
        return cpp_extension.load(
            name="pdserve_cpu_kernels",
            sources=[str(source) for source in _SOURCES],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as exc:  # no compiler, no ninja, build error
        logger.warning("CPU kernels unavailable, using the torch path: %s", exc)
        return None
