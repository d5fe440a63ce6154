"""Where pdserve's C++ CPU kernels are built, and whether they are: torch-free (as is this
package's `__init__` until a kernel is loaded), so `pdserve serve` can build them once before
its workers start (a worker's start timeout then never counts a compile, which takes a minute
or two on 2 cores) without loading torch itself.

The build folder `$PDSERVE_CACHE_DIR/kernels/cpu_kernels-<key>` is keyed by the sources, the
torch installation (its version and path: each environment builds against its own headers),
Python, the CPU, the compiler flags and the checkout the sources are in: torch's builder records
the sources' paths, so two checkouts sharing one folder rebuilt it at every switch.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import platform
import subprocess
import sys
from pathlib import Path

from services.cpu import cpu_flags
from services.env import cache_dir

KERNEL_DIR = Path(__file__).resolve().parent
SOURCES = [
    KERNEL_DIR / n for n in ("bindings.cpp", "paged_attention.cpp", "fused_ops.cpp", "threads.cpp")
]
HEADERS = [KERNEL_DIR / "exp_math.h"]  # part of the key
# -fopenmp: at::parallel_for is a header template that expands to `omp parallel` in this file,
# and the `omp simd` pragmas vectorise the float reductions. The runtime it links, libgomp.so.1,
# is the one torch has already loaded (same soname), so both share one thread pool.
# -fno-trapping-math: GCC vectorises no loop that converts float to int or rounds (the
# polynomial exps of the softmax and SiLU) while floating-point exceptions may trap; pdserve
# never enables traps, and the flag changes no result.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"]
BUILD_TIMEOUT_S = 900.0  # a first build on a slow 2-core machine, with room


def _torch_identity() -> tuple[str, str]:
    """torch's installed version and package path, read without importing it ("", "" when
    torch is not installed)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return "", ""
    try:
        return importlib.metadata.version("torch"), spec.origin
    except importlib.metadata.PackageNotFoundError:
        return "", spec.origin


def build_dir() -> Path:
    """The kernels' build folder for this environment (created)."""
    key = hashlib.sha256()
    for part in (
        *(source.read_bytes() for source in (*SOURCES, *HEADERS)),
        *(s.encode() for s in _torch_identity()),
        sys.version.encode(),
        platform.machine().encode(),
        (" ".join(cpu_flags()) or platform.processor()).encode(),
        " ".join(CFLAGS).encode(),
        str(KERNEL_DIR).encode(),
    ):
        key.update(part)
    path = cache_dir() / "kernels" / f"cpu_kernels-{key.hexdigest()[:16]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def built(folder: Path | None = None) -> bool:
    """Whether this environment's kernels are built in `folder` (None: `build_dir()`), so a
    load takes under a second."""
    return any((folder or build_dir()).glob("*.so"))


def build(timeout_s: float = BUILD_TIMEOUT_S) -> bool:
    """Build the kernels in a child process (`services.engine.kernels.load_cpu_kernels`, which
    imports torch; this process need not). True when they load afterwards; False where they
    cannot be built (no compiler: the workers then log it and use the pure-torch path) or the
    build ran past `timeout_s` seconds."""
    code = (
        "from services.engine.kernels import load_cpu_kernels as k; raise SystemExit(k() is None)"
    )
    root = Path(__file__).resolve().parents[3]
    try:
        done = subprocess.run(  # its own "compiling" line: the caller says it
            [sys.executable, "-c", code], cwd=root, timeout=timeout_s, capture_output=True
        )
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0
