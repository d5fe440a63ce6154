"""The one module that reads environment variables.

Every other module asks here, so the full list of knobs is in one place.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of pdserve's on-disk caches (converted models, compiled stubs).

    `$PDSERVE_CACHE_DIR`, default `~/.cache/pdserve`. Created on first use.
    """
    root = Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def triton_interpret() -> bool:
    """Whether Triton kernels run in Triton's CPU interpreter (`TRITON_INTERPRET=1`, which
    Triton itself reads): the Triton attention backend then runs on the CPU, for tests."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
