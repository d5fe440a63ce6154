"""Role configs as JSON: how `pdserve serve` hands a child its config (`--config-json`) and how
a service reports the config it runs with (`WorkerInfo.config_json`). Nested configs are JSON
objects, enums their values, tuples lists; `from_dict` rebuilds and validates."""

from __future__ import annotations

import dataclasses
import enum
import json
import types
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


def from_dict(cls: type[C], data: Any, base: C | None = None, path: str = "") -> C:
    """Rebuild a config of type `cls` from `to_dict` output: the fields given replace those of
    `base` (default: `cls()`), so a nested object given in part keeps its parent's defaults
    (`{"router": {"port": 0}}` keeps `pdserve serve`'s HTTP port). Every value is checked
    against its field's type first. Raises ValueError naming the field by its dotted path
    ("decode.threads: ...") for an unknown field, a wrong type or a bad value."""
    if not isinstance(data, dict):
        raise ValueError(
            f"{path.rstrip('.') or cls.__name__}: expected a JSON object, got {data!r}"
        )
    base = cls() if base is None else base
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if unknown := sorted(set(data) - known):
        raise ValueError(f"{path}{unknown[0]}: not a field of {cls.__name__}")
    changes = {
        name: _value(hints[name], value, getattr(base, name), f"{path}{name}")
        for name, value in data.items()
    }
    try:
        return dataclasses.replace(base, **changes)  # type: ignore[type-var]
    except ValueError as exc:  # the config's own check: "field: ..." without the path
        raise ValueError(f"{path}{exc}") from None


def _value(hint: Any, value: Any, base: Any, path: str) -> Any:
    """`value` as the field's type (ValueError naming `path` when it is not one)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        if value is None:
            return None
        (hint,) = [a for a in args if a is not type(None)]
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, base if dataclasses.is_dataclass(base) else None, path + ".")  # type: ignore[arg-type]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        choices = [m.value for m in hint]
        if value not in choices:
            raise ValueError(f"{path}: expected one of {choices}, got {value!r}")
        return hint(value)
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{path}: expected a list of strings, got {value!r}")
        return tuple(value)
    expected = {str: (str,), bool: (bool,), int: (int,), float: (int, float)}[hint]
    if not isinstance(value, expected) or (hint is not bool and isinstance(value, bool)):
        raise ValueError(f"{path}: expected {hint.__name__}, got {value!r}")
    return value


def from_json(cls: type[C], text: str) -> C:
    """`from_dict` of a JSON text; ValueError for bad JSON or a bad field."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"config: not JSON ({exc})") from None
    return from_dict(cls, data)
