"""Role configs as JSON: how `pdserve serve` hands a child its config (`--config-json`) and how
a service reports the config it runs with (`WorkerInfo.config_json`). Nested configs are JSON
objects, enums their values, tuples lists; `from_dict` rebuilds and validates."""

from __future__ import annotations

import dataclasses
import enum
import json
import typing
from typing import Any, TypeVar

C = TypeVar("C")


def to_dict(config: Any) -> dict[str, Any]:
    """A config as plain JSON values (nested configs as objects, enums as their values)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            value = to_dict(value)
        elif isinstance(value, enum.Enum):
            value = value.value
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def to_json(config: Any) -> str:
    return json.dumps(to_dict(config), sort_keys=True)


def from_dict(cls: type[C], data: dict[str, Any]) -> C:
    """Rebuild a config of type `cls` from `to_dict` output; ValueError names an unknown or
    bad field (fields left out keep their defaults)."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: expected a JSON object, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if unknown := sorted(set(data) - known):
        raise ValueError(f"{unknown[0]}: not a field of {cls.__name__}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            value = from_dict(hint, value)  # type: ignore[arg-type]
        elif isinstance(hint, type) and issubclass(hint, enum.Enum):
            value = hint(value)
        elif typing.get_origin(hint) is tuple and isinstance(value, list):
            value = tuple(value)
        kwargs[name] = value
    return cls(**kwargs)


def from_json(cls: type[C], text: str) -> C:
    """`from_dict` of a JSON text; ValueError for bad JSON or a bad field."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"config: not JSON ({exc})") from None
    return from_dict(cls, data)
