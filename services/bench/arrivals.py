"""When each request of a benchmark point is sent: an open-loop arrival schedule.

As `vllm bench serve` draws it: gaps from a gamma distribution with shape `burstiness` and mean
1 / `request_rate` seconds (burstiness 1 is a Poisson process; below 1 burstier, above 1 more
regular); an infinite rate sends everything at once. Seeded, so every system of a comparison
gets the same schedule.
"""

from __future__ import annotations

import math
import random


def arrival_times(
    num: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Send offsets in seconds from the start, non-decreasing, the first at 0. Raises
    ValueError naming --request-rate or --burstiness when either is not > 0."""
    if not request_rate > 0:
        raise ValueError(f"--request-rate: must be > 0 (inf: all at once), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness: must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)
    times, now = [], 0.0
    for i in range(num):
        times.append(now)
        if i + 1 < num:
            now += rng.gammavariate(burstiness, scale)
    return times
