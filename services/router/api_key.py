"""The router's API key (`--api-key`, as vLLM's): a bearer token on the public APIs.

HTTP clients send `Authorization: Bearer KEY`, gRPC clients the metadata
`authorization: Bearer KEY` (on Generate and on the router's Admin service); the scheme is
case-insensitive and the token is compared in constant time (`hmac.compare_digest`), so its
timing tells nothing about the key.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import Any

from services.common.errors import UnauthenticatedError

REDACTED = "<redacted>"  # how effective configs show a key


def bearer_matches(header: bytes | str, key: bytes) -> bool:
    """Whether an Authorization value is `Bearer <key>`."""
    raw = header.encode("latin-1", "replace") if isinstance(header, str) else header
    scheme, _, token = raw.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)


def check_metadata(metadata: Iterable[Any] | None, key: bytes | None) -> None:
    """UnauthenticatedError (-> UNAUTHENTICATED) unless a key is unset or the call's
    `authorization` metadata carries it."""
    if key is None:
        return
    values = [value for name, value in metadata or () if name == "authorization"]
    if not values or not bearer_matches(values[0], key):
        raise UnauthenticatedError("authorization: missing or wrong API key")
