"""Steps as they ran while serving, and how well a fitted model predicts them.

A worker started with `--step-log PATH` appends one JSON line per engine step: its rows
(tokens computed, tokens before them), its wall-clock seconds (schedule, forward, sampling and
bookkeeping: `Engine.step`) and the torch thread count it ran with. `pdserve profile --check
PATH` scores the saved model on them: this is the model's error on live steps, not on the
sweep it was fitted on.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from services.cost_model.step_cost import StepCost, StepShape


def shape_of(rows: Iterable[tuple[int, int]]) -> StepShape:
    """The shape of a step of `rows` (tokens computed, position of the first): a one-token row
    is a decode row of context position + 1 (a prompt's last token after a prefix-cache hit
    costs what a decode does); a longer one is a prefill chunk."""
    chunks, decodes = [], []
    for n, start in rows:
        if n == 1:
            decodes.append(start + 1)
        else:
            chunks.append((n, start))
    return StepShape(tuple(chunks), tuple(decodes))


@dataclass(frozen=True)
class StepRecord:
    """One logged step."""

    rows: tuple[tuple[int, int], ...]
    seconds: float
    threads: int

    def to_line(self) -> str:
        return json.dumps({"rows": self.rows, "s": round(self.seconds, 6), "threads": self.threads})

    @classmethod
    def from_line(cls, line: str) -> StepRecord:
        """ValueError naming `step_log` for a line that is not a step record."""
        try:
            body = json.loads(line)
            rows = tuple((int(n), int(start)) for n, start in body["rows"])
            return cls(rows, float(body["s"]), int(body["threads"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"step_log: not a step record: {line[:80]!r} ({exc})") from None


class StepLog:
    """Appends records to a file, one line each, flushed per step (a killed worker loses at
    most the step it was in)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: IO[str] = self.path.open("a", encoding="utf-8")

    def write(self, record: StepRecord) -> None:
        self._file.write(record.to_line() + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read(path: str | Path) -> list[StepRecord]:
    """Every record of a step log (blank lines skipped). OSError when unreadable; ValueError
    naming `step_log` for a malformed line."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [StepRecord.from_line(line) for line in lines if line.strip()]


@dataclass(frozen=True)
class PredictionError:
    """Absolute percent errors of a model on logged steps of one thread count."""

    threads: int
    num_steps: int
    median_pct: float
    p90_pct: float
    by_kind: dict[str, tuple[int, float]]  # "prefill" / "decode" / "mixed": (steps, median %)


def prediction_errors(
    records: Sequence[StepRecord], costs: Sequence[StepCost]
) -> list[PredictionError]:
    """Per thread count that has both logged steps and a fitted model: |predicted - measured|
    / measured, in percent. Thread counts without a model are left out."""
    by_threads = {c.threads: c for c in costs}
    errors: dict[int, list[tuple[str, float]]] = {}
    for record in records:
        cost = by_threads.get(record.threads)
        if cost is None or record.seconds <= 0 or not record.rows:
            continue
        shape = shape_of(record.rows)
        kind = "mixed" if shape.chunks and shape.decode_contexts else (
            "prefill" if shape.chunks else "decode"
        )  # fmt: skip
        pct = 100 * abs(cost.predict(shape) - record.seconds) / record.seconds
        errors.setdefault(record.threads, []).append((kind, pct))
    results = []
    for threads, items in sorted(errors.items()):
        values = sorted(pct for _, pct in items)
        kinds = {
            kind: (len(v), statistics.median(v))
            for kind in ("prefill", "decode", "mixed")
            if (v := [pct for k, pct in items if k == kind])
        }
        p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
        results.append(PredictionError(threads, len(values), statistics.median(values), p90, kinds))
    return results
