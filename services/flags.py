"""Command-line flags generated from config dataclasses, and configs rebuilt from parsed flags.

Every setting is a field of a frozen config (`EngineConfig`, `RouterConfig`, `PrefillConfig`,
...), written once with its default and one docstring line; the CLI never re-lists them. As
vLLM's `EngineArgs` does (`get_attr_docs`), a flag's help is the field's attribute docstring,
read from the class source with `ast`. A nested config field (`engine: EngineConfig`) adds the
nested fields' flags, optionally under a prefix (`--prefill-threads` for `prefill.threads`).

Field metadata (`field(metadata=flag(...))`) adjusts a flag: another name, choices, hidden
from `--help`, or no flag at all. Imports nothing heavy: `pdserve --help` answers at once.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from collections.abc import Mapping
from functools import cache
from typing import Any, TypeVar

C = TypeVar("C")
_META_KEY = "pdserve.flag"


def flag(
    *,
    name: str | None = None,
    choices: tuple[str, ...] | None = None,
    cli: bool = True,
    hidden: bool = False,
    no_flag: str | None = None,
    prefix: str = "",
    exclude: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Metadata for one config field's flag. `name`: the flag without `--` (default: the field
    name with dashes); `cli=False`: no flag; `hidden`: not shown in `--help` (test hooks);
    `no_flag`: for an optional field whose default is set, a flag that sets it to None
    (`--no-http`). For a nested config field: `prefix` goes before its fields' flag names
    and `exclude` names its fields that get no flag."""
    meta = {
        "name": name,
        "choices": choices,
        "cli": cli,
        "hidden": hidden,
        "no_flag": no_flag,
        "prefix": prefix,
        "exclude": exclude,
    }
    return {_META_KEY: meta}


@cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: its attribute docstring, joined into one line} for a dataclass and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # no source (frozen app): flags without help
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, body[1:], strict=False):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                    docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def _meta(f: dataclasses.Field) -> dict[str, Any]:
    return f.metadata.get(_META_KEY) or flag()[_META_KEY]


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    """(the type inside `X | None`, whether None is allowed)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return (inner[0] if len(inner) == 1 else str), True
    return hint, False


@dataclasses.dataclass(frozen=True)
class _Flag:
    """One generated flag: where its value goes in the config tree."""

    path: tuple[str, ...]  # field names from the root config down to this field
    dest: str  # argparse dest
    name: str  # the flag, without "--"
    is_list: bool = False  # a repeatable flag (a tuple field); not given: the default stays


def add_config_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    default: Any = None,
    *,
    prefix: str = "",
    exclude: frozenset[str] | set[str] = frozenset(),
    group: str | None = None,
) -> None:
    """Add a flag for every CLI field of dataclass `cls` (and of its nested config fields).

    `default`: the instance whose values are the flags' defaults (default: `cls()`; a nested
    field's defaults come from its value in `default`). `exclude`: dotted field paths with no
    flag ("engine.role", "prefill"). The parser remembers the flags for `config_from_args`.
    """
    default = cls() if default is None else default
    flags: list[_Flag] = parser.get_default("_config_flags") or []
    target = parser.add_argument_group(group) if group else parser
    _add(target, cls, default, prefix, (), set(exclude), flags)
    parser.set_defaults(_config_flags=flags)


def _add(parser, cls, default, prefix, path, exclude, flags) -> None:  # noqa: ANN001 - internal
    docs, hints = field_docs(cls), _hints(cls)
    for f in dataclasses.fields(cls):
        meta, here = _meta(f), (*path, f.name)
        if not meta["cli"] or ".".join(here) in exclude or not f.init:
            continue
        value = getattr(default, f.name)
        hint, optional = _unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(hint):
            nested_exclude = exclude | {".".join((*here, name)) for name in meta["exclude"]}
            target = parser
            if not path and isinstance(parser, argparse.ArgumentParser):  # a section in --help
                target = parser.add_argument_group(f.name, docs.get(f.name))
            _add(target, hint, value, prefix + meta["prefix"], here, nested_exclude, flags)
            continue
        name = prefix + (meta["name"] or f.name.replace("_", "-"))
        flag_ = _Flag(here, "cfg__" + "__".join(here), name, typing.get_origin(hint) is tuple)
        generated = f.default_factory is not dataclasses.MISSING
        shown = _help(docs.get(f.name, ""), "generated" if generated else value)
        kwargs: dict[str, Any] = {"dest": flag_.dest, "default": value}
        kwargs["help"] = argparse.SUPPRESS if meta["hidden"] else shown
        if hint is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif flag_.is_list:
            kwargs.update(action="append", default=None, metavar="HOST:PORT")
        else:
            kwargs.update(type=_parse(hint, optional), choices=meta["choices"])
            kwargs["metavar"] = None if meta["choices"] else _metavar(name, hint)
        parser.add_argument(f"--{name}", **kwargs)
        if meta["no_flag"] and value is not None:
            parser.add_argument(
                f"--{meta['no_flag']}",
                dest=flag_.dest,
                action="store_const",
                const=None,
                help=f"turn --{name} off",
            )
        flags.append(flag_)


def _metavar(name: str, hint: Any) -> str:
    """How --help shows a flag's value: PORT, N, SECONDS (every float field is one)."""
    if name.endswith("port"):
        return "PORT"
    if name.endswith("utilization"):
        return "FRACTION"
    if hint is float and name.endswith("-ms"):
        return "MS"
    return {int: "N", float: "SECONDS"}.get(hint, name.split("-")[-1].upper())


def _help(doc: str, default: Any) -> str:
    """The docstring, with the default unless the docstring already says it."""
    if "default" in doc.lower():
        return doc.replace("%", "%%")
    shown = "none" if default in ((), None) else default
    return f"{doc} (default: {shown})".lstrip().replace("%", "%%")


def _parse(hint: Any, optional: bool) -> Any:
    """argparse `type=`: the field's scalar type; "none" means None for optional fields."""
    base = hint if hint in (int, float, str) else str

    def parse(text: str) -> Any:
        if optional and text.lower() == "none":
            return None
        return base(text)

    parse.__name__ = base.__name__  # argparse names the type in its error message
    return parse


def config_from_args(args: argparse.Namespace, cls: type[C], default: C | None = None) -> C:
    """The config that the flags of `add_config_flags(parser, cls, default)` describe.

    Raises ValueError (naming the field) from the config's own validation.
    """
    root = cls() if default is None else default
    values: dict[tuple[str, ...], Any] = {}
    flags = getattr(args, "_config_flags", [])
    names = {f.path: f.name for f in flags}
    for f in flags:
        value = getattr(args, f.dest)
        if f.is_list and value is None:
            continue
        values[f.path] = tuple(value) if isinstance(value, list) else value
    return _rebuild(root, (), values, names)


def _rebuild(
    obj: Any,
    path: tuple[str, ...],
    values: Mapping[tuple[str, ...], Any],
    names: Mapping[tuple[str, ...], str],
) -> Any:
    """`obj` with the given values; a config's ValueError "field: ..." is raised again as
    "--flag: ..." when that field has a flag, so the user reads the flag they typed."""
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        here = (*path, f.name)
        if here in values:
            changes[f.name] = values[here]
        elif any(p[: len(here)] == here for p in values) and dataclasses.is_dataclass(
            getattr(obj, f.name)
        ):
            changes[f.name] = _rebuild(getattr(obj, f.name), here, values, names)
    if not changes:
        return obj
    try:
        return dataclasses.replace(obj, **changes)
    except ValueError as exc:
        field_name, sep, rest = str(exc).partition(": ")
        name = names.get((*path, field_name))
        if sep and name is not None:
            raise ValueError(f"--{name}: {rest}") from None
        raise


def flag_message(args: argparse.Namespace, message: str) -> str:
    """An error message "field: ..." from a config or a service, with the field replaced by
    the flag that sets it when exactly one flag of this command does ("--port: ...")."""
    field_name, sep, rest = message.partition(": ")
    flags = [f for f in getattr(args, "_config_flags", []) if f.path[-1] == field_name]
    return f"--{flags[0].name}: {rest}" if sep and len(flags) == 1 else message
