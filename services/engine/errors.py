"""Typed engine errors. The services map them to gRPC codes in one interceptor.

Tier 1 (internal invariants) uses `assert`; these are tiers 2 and 3: bad input and resources.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """Bad user input (-> INVALID_ARGUMENT). `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ResourceExhaustedError(EngineError):
    """Not enough KV blocks or request slots (-> RESOURCE_EXHAUSTED)."""


class RequestNotFoundError(EngineError, KeyError):
    """Unknown request id (-> NOT_FOUND)."""


class KVTransferError(EngineError):
    """Pulling a request's KV from its source failed. `reason` says how, for metrics and status
    codes: "unavailable" (the source is gone), "deadline_exceeded" (it stalled), "not_found" (it
    no longer holds the KV), "handshake" (incompatible layouts), or another lower-case name."""

    def __init__(self, message: str, reason: str = "failed") -> None:
        super().__init__(message)
        self.reason = reason


class KVNotFoundError(KVTransferError, RequestNotFoundError):
    """The source no longer holds (or never held) the KV a handle names: a KVTransferError with
    reason "not_found" that is also a RequestNotFoundError, so every backend reports an ended
    transfer alike."""

    def __init__(self, message: str) -> None:
        KVTransferError.__init__(self, message, reason="not_found")


class KVHandshakeError(KVTransferError):
    """Two engines whose KV layouts or models differ were asked to exchange KV
    (-> FAILED_PRECONDITION); the message names every differing field."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="handshake")
