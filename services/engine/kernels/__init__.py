"""C++ kernels built on first use: CPU paged decode attention, fused layer ops, OpenMP pins."""

# Built with torch's extension builder (a C++ compiler and ninja; a minute or two on 2 cores) into
# `cache.build_dir()`, keyed by the source, torch, this CPU and the checkout, so
# later processes load it in well under a second; `pdserve serve` builds it before its workers.
# Where it cannot be built, `load_cpu_kernels()` returns None and attention and the layer ops fall
# back to the pure-torch path.

from __future__ import annotations

import functools
import logging
import sys
import time
from pathlib import Path
from types import ModuleType

from services.engine.kernels import cache

logger = logging.getLogger(__name__)


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

    folder = cache.build_dir()
    _clear_stale_lock(folder / "lock")
    if not cache.built(folder):
        print(
            f"pdserve: compiling the CPU kernels once (a minute or two on 2 cores): {folder}",
            file=sys.stderr,
            flush=True,
        )
    try:
        return cpp_extension.load(
            name="pdserve_cpu_kernels",
            sources=[str(source) for source in cache.SOURCES],
            extra_cflags=cache.CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as exc:  # no compiler, no ninja, build error
        logger.warning("CPU kernels unavailable, using the torch path: %s", exc)
        return None
