"""The n sequences of one prompt (OpenAI's `n`) sharing the prompt's KV blocks.

The first sequence (the leader) runs as any request. Each other one waits until the leader's
prefill is done, then prefills on the same worker, whose prefix cache holds the prompt's full
blocks: only the last, partial block is computed again, and its first token is sampled with
its own seed from its own logits. It then waits until the leader's KV has landed on its decode
worker, and decodes there: that worker's prefix cache holds the full blocks too, so only the
tail block is pulled. Full blocks are shared by reference on both workers, as vLLM's parallel
sampling shares them through its prefix cache. If the leader ends or fails before either
point, the others route on their own (correct, only without the sharing).
"""

from __future__ import annotations

import threading


class Siblings:
    """Where the leader prefilled and decodes, published once each (thread-safe)."""

    def __init__(self) -> None:
        self._prefill: str | None = None
        self._decode: str | None = None
        self._prefilled = threading.Event()
        self._landed = threading.Event()

    def prefilled(self, address: str | None) -> None:
        """The leader's prefill is done on `address` (None: it failed, route freely)."""
        if not self._prefilled.is_set():
            self._prefill = address
            self._prefilled.set()

    def landed(self, address: str | None) -> None:
        """The leader's prompt KV is in the decode worker at `address`'s cache (None: never)."""
        if not self._landed.is_set():
            self._decode = address
            self._landed.set()

    def ended(self) -> None:
        """The leader is over: whatever it did not publish, the others no longer wait for."""
        self.prefilled(None)
        self.landed(None)

    def prefill_worker(self, timeout: float) -> str | None:
        """Waits (at most `timeout` seconds) for the leader's prefill worker."""
        self._prefilled.wait(max(timeout, 0.0))
        return self._prefill

    def decode_worker(self, timeout: float) -> str | None:
        """Waits (at most `timeout` seconds) for the leader's decode worker."""
        self._landed.wait(max(timeout, 0.0))
        return self._decode
