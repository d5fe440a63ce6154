"""An exclusive lock between processes on one host: the model conversion and the worker's
start-up profile each run once however many processes want them at the same time."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive fcntl lock on `path` (created if missing), released on exit or process death."""
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
