"""Log set-up of every pdserve process: one stderr handler, as text or as JSON lines.

`--log-format text` (default): `TIME LEVEL [ROLE] LOGGER request_id=ID: MESSAGE`. `--log-format
json`: one JSON object per line (python-json-logger) with `time`, `level`, `logger`, `message`,
`role`, `pid` and `request_id`, and whatever a call adds with `extra=`; what log shippers (Loki,
Vector, Fluent Bit) parse without a custom pattern. `pdserve serve` passes its format on to the
processes it starts (`PDSERVE_LOG_FORMAT`), and relays their JSON lines unchanged.
"""

from __future__ import annotations

import logging
import os
import sys

from services.common.request_id import RequestIdFilter

LOG_FORMATS = ("text", "json")
ENV = "PDSERVE_LOG_FORMAT"
_HANDLER_NAME = "pdserve"
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
    value = os.environ.get(ENV, "text")
    return value if value in LOG_FORMATS else "text"


def configure(log_format: str, role: str, level: int = logging.INFO) -> None:
    """Route every logger of this process to stderr in `log_format` ("text" or "json"), each
    record tagged with `role` and the bound request id. Raises ValueError naming `log_format`."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format: expected one of {list(LOG_FORMATS)}, got {log_format!r}")
    handler = _StderrHandler()
    handler.addFilter(_RoleFilter(role))
    handler.addFilter(RequestIdFilter())
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
    handler.set_name(_HANDLER_NAME)
    root = logging.getLogger()
    for old in list(root.handlers):  # a second call replaces ours, and only ours
        if old.get_name() == _HANDLER_NAME:
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
