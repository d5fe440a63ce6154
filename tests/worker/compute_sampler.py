"""Samples where the engine compute threads of worker processes run, about every millisecond.

A compute thread is one whose Linux name ends in `-step` (an engine thread while it steps, and
its OpenMP team: `EngineLoop`). Each sample reads the core ledger, then every compute thread's
/proc/<pid>/task/<tid>/stat (state, last CPU), then the ledger again; a sample whose two ledger
reads differ is dropped (a lend changed hands in between). What it counts:

- `shared`: samples where two running compute threads (state R) sat on one CPU;
- `off_ledger`: samples where a running compute thread sat on a CPU its worker did not hold
  (a lender computing on a lent CPU, or a borrower on one it gave back).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from services.worker.core_ledger import CoreLedger

COMPUTE_SUFFIX = "-step"


@dataclass
class Samples:
    taken: int = 0
    dropped: int = 0
    running: int = 0  # running compute threads seen, summed over samples
    shared: list[tuple] = field(default_factory=list)
    off_ledger: list[tuple] = field(default_factory=list)
    holders_seen: Counter = field(default_factory=Counter)  # (cpu, holder) -> samples


def _stat(pid: int, tid: str) -> tuple[str, str, int] | None:
    """(name, state, last CPU) of one thread, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    except OSError:
        return None
    name = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    return name, fields[0], int(fields[36])


class ComputeSampler:
    """`workers`: pid -> its name in the ledger at `ledger_path`. Use as a context manager."""

    def __init__(self, workers: dict[int, str], ledger_path: str, period: float = 0.001) -> None:
        self.workers = workers
        self.ledger = CoreLedger(Path(ledger_path), None)
        self.period = period
        self.samples = Samples()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ComputeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.ledger.close()

    def _threads(self) -> dict[int, list[str]]:
        out = {}
        for pid in self.workers:
            try:
                out[pid] = os.listdir(f"/proc/{pid}/task")
            except OSError:
                out[pid] = []
        return out

    def _run(self) -> None:
        tasks, listed = self._threads(), time.monotonic()
        while not self._stop.is_set():
            if time.monotonic() - listed > 0.05:  # teams grow: list the threads again
                tasks, listed = self._threads(), time.monotonic()
            before = self.ledger.holders()
            running: list[tuple[int, str, int]] = []  # (pid, tid, cpu)
            for pid, tids in tasks.items():
                for tid in tids:
                    stat = _stat(pid, tid)
                    if stat and stat[0].endswith(COMPUTE_SUFFIX) and stat[1] == "R":
                        running.append((pid, tid, stat[2]))
            after = self.ledger.holders()
            self._record(before, after, running)
            time.sleep(self.period)

    def _record(self, before: dict, after: dict, running: list[tuple[int, str, int]]) -> None:
        s = self.samples
        if before != after:
            s.dropped += 1
            return
        s.taken += 1
        s.running += len(running)
        for cpu, holder in before.items():
            s.holders_seen[(cpu, holder)] += 1
        cpus = Counter(cpu for _, _, cpu in running)
        if any(n > 1 for n in cpus.values()):
            s.shared.append(tuple(running))
        for pid, tid, cpu in running:
            if before.get(cpu) != self.workers[pid]:
                s.off_ledger.append((self.workers[pid], tid, cpu, before))
