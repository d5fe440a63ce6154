"""How far the router's first-token predictions were off, per serving path and state of the
decode worker: the calibration each path's next predictions are scaled by (`serving_path.py`).
Torch-free."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

PATHS = ("local", "remote")
DECODE_STATES = ("idle", "streaming")
"""The decode worker's state at a choice, which each path's calibration is kept apart by: with
streams running, a local prompt waits for the step in flight and is chunked beside the streams,
and a remote one waits for the prefill worker to take back its CPU from the decode worker and
computes on one core beside the router; idle, each borrows the other worker's CPU. Measured: the
remote path's first tokens came 1.3-1.7x its prediction beside streams, about 1.1x idle (W1 on
a 2-core AMX Xeon, docs/benchmarks.md), so one shared ratio sent prompts beside streams remote
after idle choices had pulled it down, and they missed."""
CALIBRATION_WEIGHT = 0.2
"""Weight of the newest observation in `PathCalibration`'s exponentially weighted ratio."""
CALIBRATION_BOUNDS = (0.5, 4.0)
"""The range a path's observed / predicted ratio is kept in (one outlier cannot flip a path)."""
CALIBRATION_DECAY_S = 10.0
"""Time constant (seconds) over which a path's ratio returns to 1.0 without new observations: a
path judged slow under a burst is chosen less, so it would otherwise keep the burst's ratio
long after the burst (measured: under the suite's quick W1 check, after a point past the knee
the local path's ratio sent half of a lighter point's prompts to a one-core prefill worker
whose TTFT missed the objective)."""
CALIBRATION_SPREAD_PRIOR = 0.15
"""The spread (standard deviation of observed / predicted) a path is assumed to have before its
observations say otherwise, and returns to with the ratio: the router's live first-token
predictions were within about 15% (docs/benchmarks.md, the suite's quick W1 checks)."""
Z_P90 = 1.2816
"""The standard normal's 90th percentile: `PathCalibration.upper` is the ratio a path's first
token stays within for about 90% of requests, the attainment the goodput counts."""


class PathCalibration:
    """Observed over predicted seconds to the first token, per path and decode state
    (`DECODE_STATES`: `streaming` or not), as an exponentially
    weighted mean (`CALIBRATION_WEIGHT`, kept within `CALIBRATION_BOUNDS`; 1.0 until a path's
    first observation) and variance (West's incremental form, as for the mean), both decaying
    back to their priors (1.0, `CALIBRATION_SPREAD_PRIOR`) between observations
    (`CALIBRATION_DECAY_S`). One per router; thread-safe. `clock`: seconds (time.monotonic)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        keys = [(path, streaming) for path in PATHS for streaming in (False, True)]
        self._ratio = dict.fromkeys(keys, 1.0)
        self._variance = dict.fromkeys(keys, CALIBRATION_SPREAD_PRIOR**2)
        self._at = dict.fromkeys(keys, 0.0)  # when each ratio was last set

    def observe(
        self, path: str, predicted_s: float, observed_s: float, streaming: bool = False
    ) -> None:
        """One request's `path` ("local" | "remote"), chosen while the decode worker was
        `streaming` (had running streams) or not, was predicted to reach its first token in
        `predicted_s` and did in `observed_s` seconds. Raises ValueError for another path."""
        key = _key(path, streaming)
        if predicted_s <= 0 or observed_s <= 0:
            return
        low, high = CALIBRATION_BOUNDS
        ratio = min(max(observed_s / predicted_s, low), high)
        with self._lock:
            now = self._clock()
            old, variance = self._decayed(key, now)
            step = ratio - old
            self._ratio[key] = old + CALIBRATION_WEIGHT * step
            self._variance[key] = (1 - CALIBRATION_WEIGHT) * (
                variance + CALIBRATION_WEIGHT * step * step
            )
            self._at[key] = now

    def scale(self, path: str, streaming: bool = False) -> float:
        """The factor `path`'s predictions are multiplied by (the ratio's mean) in that state of
        the decode worker. Raises ValueError for another path."""
        key = _key(path, streaming)
        with self._lock:
            return self._decayed(key, self._clock())[0]

    def upper(self, path: str, streaming: bool = False) -> float:
        """The ratio `path`'s first tokens stay within about 90% of the time in that state: the
        mean plus `Z_P90` standard deviations. A prediction times this meets a TTFT objective
        with the margin a 90% attainment needs, where the mean alone meets it half the time.
        Raises ValueError for another path."""
        key = _key(path, streaming)
        with self._lock:
            ratio, variance = self._decayed(key, self._clock())
        return ratio + Z_P90 * math.sqrt(variance)

    def _decayed(self, key: tuple[str, bool], now: float) -> tuple[float, float]:
        weight = math.exp(-max(now - self._at[key], 0.0) / CALIBRATION_DECAY_S)
        prior = CALIBRATION_SPREAD_PRIOR**2
        return (
            1.0 + (self._ratio[key] - 1.0) * weight,
            prior + (self._variance[key] - prior) * weight,
        )


def decode_state(streaming: bool) -> str:
    """The metric label of a decode state (`DECODE_STATES`)."""
    return DECODE_STATES[streaming]


def _key(path: str, streaming: bool) -> tuple[str, bool]:
    if path not in PATHS:
        raise ValueError(f"path: expected one of {PATHS}, got {path!r}")
    return path, bool(streaming)
