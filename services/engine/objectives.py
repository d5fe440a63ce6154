"""A stream's own service-level objectives, which the per-step token budget keeps
(`step_budget.py`); what a stream leaves unset is the engine's `slo_itl_ms` / `slo_tpot_ms`."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from services.engine.errors import InvalidRequestError


@dataclass(frozen=True)
class StreamObjectives:
    """`itl_s`: the stream's ITL objective; `tpot_s`: its mean-TPOT objective (seconds; None:
    the engine's default); `ttft_s`: its prompt's TTFT objective, counted from the engine's
    arrival (seconds; None: none). Raises InvalidRequestError naming a field that is not > 0."""

    itl_s: float | None = None
    tpot_s: float | None = None
    ttft_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("itl_s", "tpot_s", "ttft_s"):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if value is not None and not (number and 0 < value < math.inf):
                raise InvalidRequestError(f"{name}", f"must be > 0 seconds, got {value!r}")

    @classmethod
    def from_ms(cls, itl_ms: float, tpot_ms: float, ttft_ms: float = 0.0) -> StreamObjectives:
        """From wire fields in milliseconds (0: unset; a tiny one stays > 0 in seconds)."""

        def seconds(ms: float) -> float | None:
            return max(ms / 1000, sys.float_info.min) if ms > 0 else None

        return cls(seconds(itl_ms), seconds(tpot_ms), seconds(ttft_ms))
