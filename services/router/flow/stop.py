"""Stop strings over streamed text: emit what is safe, hold back what might start a stop string.

A stop string can span several tokens (and so several text deltas), and it is never emitted.
The matcher keeps the longest suffix of the text seen so far that is a proper prefix of some
stop string; only text before that suffix is safe to emit. Any future match must start inside
the held-back suffix, so checking `held + delta` finds every match exactly once.

When several stop strings match, the one that *completes* first wins (smallest end offset; on a
tie, the earliest start). That rule is the only one that does not depend on how the text was
split into deltas: a streaming client cannot know about a match that ends in text not yet seen.
vLLM's `StopChecker` (vllm/v1/engine/detokenizer.py) holds back and truncates the same way.
"""

from __future__ import annotations

from collections.abc import Iterable


def first_stop_match(text: str, stop: Iterable[str]) -> int | None:
    """Start offset (chars) of the stop string that completes first in `text`, or None.

    Ties on the end offset go to the earliest start (the longer string).
    """
    best: tuple[int, int] | None = None  # (end, start)
    for s in stop:
        start = text.find(s)
        if start >= 0 and (best is None or (start + len(s), start) < best):
            best = (start + len(s), start)
    return None if best is None else best[1]


def _held_back_length(text: str, stop: tuple[str, ...], max_hold: int) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    for length in range(min(max_hold, len(text)), 0, -1):
        suffix = text[-length:]
        if any(len(s) > length and s.startswith(suffix) for s in stop):
            return length
    return 0


class StopStringMatcher:
    """Filters one request's text deltas through its stop strings.

    `add(delta)` returns (text safe to emit now, stopped). Once stopped, the stop string and
    everything after it are dropped and later calls return ("", True). `flush()` releases the
    held-back text when the request ends another way (EOS, max_tokens). Emitted text only ever
    appends: the concatenation of everything returned is a prefix of the input text.

    Raises ValueError (naming `stop`) for an empty stop string, which would match everywhere.
    """

    def __init__(self, stop: Iterable[str] = ()) -> None:
        self._stop = tuple(dict.fromkeys(stop))  # dedupe, keep order
        if any(not isinstance(s, str) or not s for s in self._stop):
            raise ValueError("stop: stop strings must be non-empty strings")
        self._max_hold = max((len(s) for s in self._stop), default=1) - 1
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """True once a stop string has matched."""
        return self._stopped

    @property
    def held_back(self) -> str:
        """Text received but not yet emitted (it might be the start of a stop string)."""
        return self._held

    def add(self, delta: str) -> tuple[str, bool]:
        """Feeds the next text delta; returns (text safe to emit, stopped)."""
        if self._stopped:
            return "", True
        text = self._held + delta
        if not self._stop:
            self._held = ""
            return text, False
        start = first_stop_match(text, self._stop)
        if start is not None:
            self._held, self._stopped = "", True
            return text[:start], True
        hold = _held_back_length(text, self._stop, self._max_hold)
        self._held = text[len(text) - hold :]
        return text[: len(text) - hold], False

    def flush(self) -> str:
        """Releases the held-back text (the request ended without a stop string); "" if stopped."""
        text, self._held = self._held, ""
        return "" if self._stopped else text
