"""One request id from the client to every service, and in every log line about the request.

The router takes the client's id from the `x-request-id` HTTP header or gRPC metadata key (the
header vLLM, SGLang and most proxies use), or generates one, returns it the same way, and sends it
as `x-request-id` metadata on each Prefill and Decode call; every service binds it to a context
variable while it works on the request, and `RequestIdFilter` puts it on each log record
(`services/common/logs.py` prints it). Ids the engine needs to be unique per sequence (KV handles,
n choices) are derived from it as `{request_id}-{suffix}`.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
import uuid
from collections.abc import Generator, Iterable, Iterator
from typing import Any, TypeVar

HEADER = "x-request-id"
MAX_LENGTH = 128
# ASCII letters, digits and a few marks: valid gRPC metadata, no spaces or quotes, safe in logs.
_ALLOWED = re.compile(r"[A-Za-z0-9_.:/@+=-]{1,128}", re.ASCII)
T = TypeVar("T")

current: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


def new_request_id() -> str:
    """A fresh id (32 hex digits, as OpenAI-style `cmpl-...` ids carry)."""
    return uuid.uuid4().hex


def accept(value: str | bytes | None) -> str | None:
    """The client's id if it is usable (1-128 ASCII letters, digits and `_.:/@+=-`),
    else None (the caller generates one: a bad id is replaced, never an error)."""
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if value and _ALLOWED.fullmatch(value):
        return value
    return None


def from_metadata(metadata: Iterable[Any] | None) -> str | None:
    """The usable `x-request-id` of a gRPC call's invocation metadata, if any."""
    for item in metadata or ():
        if item[0] == HEADER:
            return accept(item[1])
    return None


def metadata(request_id: str | None = None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying `request_id` (default: the bound one); empty without one."""
    request_id = request_id or current.get()
    return ((HEADER, request_id),) if request_id else ()


@contextlib.contextmanager
def bound(request_id: str | None) -> Iterator[None]:
    """Log records made inside the block carry `request_id`."""
    token = current.set(request_id)
    try:
        yield
    finally:
        current.reset(token)


def bind_stream(stream: Iterator[T], request_id: str | None) -> Generator[T, None, None]:
    """`stream`'s items, each produced with `request_id` bound. Rebinds around every step, so it
    is right when the consumer resumes it on another thread (the HTTP API's flow threads) and
    leaves nothing bound while the stream is suspended."""
    try:
        while True:
            with bound(request_id):
                try:
                    item = next(stream)
                except StopIteration:
                    return
            yield item
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            with bound(request_id):
                close()


class RequestIdFilter(logging.Filter):
    """Adds `record.request_id` (the bound id, or "-") to every record it sees."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = current.get() or "-"
        return True
