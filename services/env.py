"""The one module that reads environment variables.

Every other module asks here, so the full list of knobs is in one place.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

LOG_FORMAT = "PDSERVE_LOG_FORMAT"
API_KEY = "PDSERVE_API_KEY"  # the router's key, and what clients send, when no flag says
LOGGING_LEVEL = "PDSERVE_LOGGING_LEVEL"
LOGGING_LEVELS = {
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
    "CRITICAL": logging.CRITICAL,
}


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


def log_format() -> str | None:
    """`$PDSERVE_LOG_FORMAT` as set ("text" or "json" mean something; `services/common/logs.py`
    judges), None when unset. `pdserve serve` sets it for its children to its `--log-format`."""
    return os.environ.get(LOG_FORMAT)


def logging_level() -> int:
    """The level every pdserve process logs at: `$PDSERVE_LOGGING_LEVEL` (DEBUG, INFO, WARNING,
    ERROR or CRITICAL, any case; default INFO), as vLLM's `VLLM_LOGGING_LEVEL`. `pdserve serve`'s
    children inherit it. Raises ValueError naming the variable on any other value."""
    value = os.environ.get(LOGGING_LEVEL, "INFO")
    name = value.strip().upper()
    if name not in LOGGING_LEVELS:
        raise ValueError(
            f"{LOGGING_LEVEL}: expected one of {', '.join(LOGGING_LEVELS)}, got {value!r}"
        )
    return LOGGING_LEVELS[name]


def api_key() -> str | None:
    """`$PDSERVE_API_KEY`: the router's API key when its config sets none, and the key a client
    command (`generate`, `status`, `bench serve`) or a registering worker sends when no flag
    gives one (as users pass secrets, off the command line). None when unset."""
    return os.environ.get(API_KEY)
