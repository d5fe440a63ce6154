"""Blocking calls on Serve deployment handles from replica code.

A replica's constructor runs on its asyncio event loop, where `DeploymentResponse.result()` is
refused; pdserve's replicas are threaded (gRPC servers, engine loops) and call their registry
synchronously. `call` runs the call on a helper thread, so it works from any thread.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

CALL_TIMEOUT_S = 30.0
_EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="serve-call")


def call(handle: Any, method: str, *args: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
    """`handle.<method>.remote(*args).result()` off the event loop; raises what the call raises,
    or TimeoutError after `timeout_s` seconds."""

    def run() -> Any:
        return getattr(handle, method).remote(*args).result(timeout_s=timeout_s)

    return _EXECUTOR.submit(run).result(timeout=timeout_s + 1.0)
