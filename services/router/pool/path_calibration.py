"""How far the router's first-token predictions were off, per serving path: the calibration
each path's next predictions are scaled by (`serving_path.py`). Torch-free."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

PATHS = ("local", "remote")
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


class PathCalibration:
    """Observed over predicted seconds to the first token, per path, as an exponentially
    weighted mean (`CALIBRATION_WEIGHT`, kept within `CALIBRATION_BOUNDS`; 1.0 until a path's
    first observation) that decays back to 1.0 between observations (`CALIBRATION_DECAY_S`).
    One per router; thread-safe. `clock`: seconds (time.monotonic)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._ratio = dict.fromkeys(PATHS, 1.0)
        self._at = dict.fromkeys(PATHS, 0.0)  # when each ratio was last set

    def observe(self, path: str, predicted_s: float, observed_s: float) -> None:
        """One request's `path` ("local" | "remote") was predicted to reach its first token in
        `predicted_s` and did in `observed_s` seconds. Raises ValueError for another path."""
        if path not in self._ratio:
            raise ValueError(f"path: expected one of {PATHS}, got {path!r}")
        if predicted_s <= 0 or observed_s <= 0:
            return
        low, high = CALIBRATION_BOUNDS
        ratio = min(max(observed_s / predicted_s, low), high)
        with self._lock:
            now = self._clock()
            old = self._decayed(path, now)
            self._ratio[path] = old + CALIBRATION_WEIGHT * (ratio - old)
            self._at[path] = now

    def scale(self, path: str) -> float:
        """The factor `path`'s predictions are multiplied by."""
        with self._lock:
            return self._decayed(path, self._clock())

    def _decayed(self, path: str, now: float) -> float:
        weight = math.exp(-max(now - self._at[path], 0.0) / CALIBRATION_DECAY_S)
        return 1.0 + (self._ratio[path] - 1.0) * weight
