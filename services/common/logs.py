"""Log set-up of every pdserve process: one stderr handler, as text or as JSON lines, and an
optional log file that gets the same records.

`--log-format text` (default): `TIME LEVEL [ROLE] LOGGER request_id=ID: MESSAGE`. `--log-format
json`: one JSON object per line (python-json-logger) with `time`, `level`, `logger`, `message`,
`role`, `pid` and `request_id`, and whatever a call adds with `extra=`; what log shippers (Loki,
Vector, Fluent Bit) parse without a custom pattern. The level is `$PDSERVE_LOGGING_LEVEL`
(`services/env.py`, default INFO). `--log-file PATH` appends the same lines to PATH as well.
`pdserve serve` passes its format on to the processes it starts (`PDSERVE_LOG_FORMAT`; they
inherit the level), relays their lines (JSON ones unchanged) to its stderr and, with
`--log-file`, into its log file: one writer, so lines from several processes never interleave.
"""

from __future__ import annotations

import logging
import sys

from services import env
from services.common.request_id import RequestIdFilter

LOG_FORMATS = ("text", "json")
_HANDLER_NAME = "pdserve"
_FILE_HANDLER_NAME = "pdserve-file"
_TEXT = "%(asctime)s %(levelname)s [%(role)s] %(name)s request_id=%(request_id)s: %(message)s"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record comes (as logging's last-resort handler
    does), so a replaced stderr (a test's capture) is never written to after it closed."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class _RoleFilter(logging.Filter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def filter(self, record: logging.LogRecord) -> bool:
        record.role = self.role
        return True


def _drop_color_message(record: logging.LogRecord) -> bool:
    """uvicorn adds an ANSI-coloured copy of its message; JSON keeps the plain one."""
    record.__dict__.pop("color_message", None)
    return True


def default_format() -> str:
    """`$PDSERVE_LOG_FORMAT` when it names a format, else "text"."""
    value = env.log_format()
    return value if value in LOG_FORMATS else "text"


def configure(
    log_format: str, role: str, level: int | None = None, log_file: str | None = None
) -> None:
    """Route every logger of this process to stderr in `log_format` ("text" or "json"), each
    record tagged with `role` and the bound request id, at `level` (default:
    `$PDSERVE_LOGGING_LEVEL`), and append the same lines to `log_file` when given. A second call
    replaces what a first one installed. Raises ValueError naming `log_format`, `log_file` or
    the level variable."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format: expected one of {list(LOG_FORMATS)}, got {log_format!r}")
    level = env.logging_level() if level is None else level
    handlers: list[logging.Handler] = [_StderrHandler()]
    handlers[0].set_name(_HANDLER_NAME)
    if log_file is not None:
        try:
            file_handler = logging.FileHandler(log_file, mode="a", encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"log_file: cannot append to {log_file!r}: {exc.strerror}") from exc
        file_handler.set_name(_FILE_HANDLER_NAME)
        handlers.append(file_handler)
    root = logging.getLogger()
    for old in list(root.handlers):  # a second call replaces ours, and only ours
        if old.get_name() in (_HANDLER_NAME, _FILE_HANDLER_NAME):
            root.removeHandler(old)
            old.close()
    for handler in handlers:
        _set_format(handler, log_format, role)
        root.addHandler(handler)
    root.setLevel(level)


def _set_format(handler: logging.Handler, log_format: str, role: str) -> None:
    handler.addFilter(_RoleFilter(role))
    handler.addFilter(RequestIdFilter())
    handler.log_format = log_format  # type: ignore[attr-defined]  # read by current_format()
    if log_format == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s %(role)s %(process)d "
                "%(request_id)s",
                rename_fields={
                    "asctime": "time",
                    "levelname": "level",
                    "name": "logger",
                    "process": "pid",
                },
                datefmt="%Y-%m-%dT%H:%M:%S%z",  # ISO 8601 with the offset
            )
        )
        handler.addFilter(_drop_color_message)
    else:
        handler.setFormatter(logging.Formatter(_TEXT))


def _ours(name: str) -> logging.Handler | None:
    return next((h for h in logging.getLogger().handlers if h.get_name() == name), None)


def current_format() -> str:
    """The format `configure` set up in this process ("text" when it was not called)."""
    return getattr(_ours(_HANDLER_NAME), "log_format", "text")


def lets_through(level: int) -> bool:
    """Whether a record at `level` passes the level `configure` set (True when not called)."""
    return _ours(_HANDLER_NAME) is None or logging.getLogger().isEnabledFor(level)


def write_line(line: str) -> None:
    """One line formatted elsewhere (a child's line `pdserve serve` relays, or its own
    `pdserve: ...` message) to stderr and, when `configure` opened one, the log file. Whole
    lines only, under the file handler's lock; a closed stderr or file drops the line."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # our stderr is gone; the line has nowhere to go there
        pass
    handler = _ours(_FILE_HANDLER_NAME)
    if not isinstance(handler, logging.FileHandler):
        return
    handler.acquire()
    try:
        if handler.stream is not None:  # None once closed
            handler.stream.write(line + "\n")
            handler.stream.flush()
    except (OSError, ValueError):
        pass
    finally:
        handler.release()
