"""Which worker computes on which CPU of one node: the ledger core lending runs on.

Every CPU of the node's pools has a home worker (its owner, from `pdserve serve`'s placement)
and a holder (the one worker whose engine threads may run on it now, or nobody). A worker with
nothing to do lends its home CPUs (holder: nobody); a worker with work borrows free CPUs of
others; an owner whose work comes back reclaims its CPUs: the free ones at once, the borrowed
ones once their borrower gives them back at the end of its step. A CPU has one holder at a
time, so no two workers' compute threads ever run on it together (the issue's rule), and a
worker only computes on the CPUs it holds. TaiChi and semi-PD move compute between phases on
GPUs the same way, at the granularity their hardware allows; here it is a core.

The ledger is a small file (under /dev/shm) that every worker of the node maps: a header of
worker names, then one record per CPU (cpu id, owner, holder, reclaim flag, generation, the
holder's pid: a CPU whose holder died goes back to its owner, `recover`). Every
change runs under an exclusive `fcntl` lock of the file (and a thread lock in this process), so
it is atomic across processes; a reader sees whole records.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

NOBODY = -1
_HEADER_BYTES = 4096  # JSON: {"workers": [...], "num_cpus": N}, zero-padded
_FIELDS = ("cpu", "owner", "holder", "reclaim", "generation", "pid")  # int64 each, per CPU


class CoreLedger:
    """One worker's view of the node's ledger (`open`), or the supervisor's (`create`)."""

    def __init__(self, path: Path, worker: str | None) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR)
        header = json.loads(os.pread(self._fd, _HEADER_BYTES, 0).rstrip(b"\0"))
        self.workers: list[str] = header["workers"]
        size = _HEADER_BYTES + header["num_cpus"] * len(_FIELDS) * 8
        self._map = mmap.mmap(self._fd, size)
        self._records = np.frombuffer(self._map, dtype=np.int64, offset=_HEADER_BYTES).reshape(
            header["num_cpus"], len(_FIELDS)
        )
        self._lock = threading.Lock()
        if worker is not None and worker not in self.workers:
            raise ValueError(f"core_ledger: {worker!r} is not one of {self.workers}")
        self.me = self.workers.index(worker) if worker is not None else NOBODY
        self.pid = os.getpid()

    @classmethod
    def create(cls, path: str | Path, home_cpus: Mapping[str, Sequence[int]]) -> CoreLedger:
        """Write a ledger where each worker holds its own CPUs (`home_cpus`: worker name -> its
        CPUs, none shared). ValueError naming `home_cpus` for a CPU given twice."""
        cpus = [(c, name) for name, owned in home_cpus.items() for c in owned]
        if len({c for c, _ in cpus}) != len(cpus):
            raise ValueError(f"home_cpus: a CPU has two owners: {dict(home_cpus)}")
        workers = list(home_cpus)
        header = json.dumps({"workers": workers, "num_cpus": len(cpus)}).encode()
        records = np.array(
            [[c, workers.index(n), workers.index(n), 0, 0, 0] for c, n in sorted(cpus)],
            dtype=np.int64,
        ).reshape(len(cpus), len(_FIELDS))
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(header.ljust(_HEADER_BYTES, b"\0") + records.tobytes())
        tmp.replace(path)
        return cls(path, None)

    @classmethod
    def open(cls, path: str | Path, worker: str) -> CoreLedger:
        """`worker`'s view of the ledger at `path`. OSError when it cannot be read; ValueError
        naming `core_ledger` for a worker it does not list."""
        return cls(Path(path), worker)

    @classmethod
    def cpus_of(cls, path: str | Path) -> list[int]:
        """Every CPU the ledger at `path` lists (what its workers may run on). OSError when it
        cannot be read."""
        ledger = cls(Path(path), None)
        try:
            return sorted(int(c) for c in ledger._records[:, 0])
        finally:
            ledger.close()

    def close(self) -> None:
        del self._records
        self._map.close()
        os.close(self._fd)

    @contextmanager
    def _locked(self) -> Iterator[np.ndarray]:
        with self._lock:
            fcntl.lockf(self._fd, fcntl.LOCK_EX)
            try:
                yield self._records
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN)

    def _cpus(self, rows: np.ndarray) -> list[int]:
        return [int(c) for c in self._records[rows, 0]]

    # -- what a worker reads -------------------------------------------------------------------

    def home(self) -> list[int]:
        """This worker's own CPUs."""
        return self._cpus(self._records[:, 1] == self.me)

    def held(self) -> list[int]:
        """The CPUs this worker may compute on now (its own it has not lent, and borrowed ones),
        in CPU order."""
        with self._locked() as r:
            return self._cpus(r[:, 2] == self.me)

    def holders(self) -> dict[int, str | None]:
        """CPU -> the worker computing on it now (None: lent and free)."""
        with self._locked() as r:
            return {
                int(cpu): (self.workers[int(h)] if h != NOBODY else None) for cpu, h in r[:, [0, 2]]
            }

    def reclaimed(self) -> bool:
        """Whether an owner wants back a CPU this worker borrowed (give it back after the step)."""
        with self._locked() as r:
            return self._asked_back(r)

    def reclaim_asked(self) -> bool:
        """`reclaimed` without the lock, for a check between two layers of a step: a record is
        one aligned int64 each, so a read sees a flag either set or not; a flag set just after
        the read is seen at the next check."""
        return self._asked_back(self._records)

    def _asked_back(self, r: np.ndarray) -> bool:
        """Whether a CPU this worker holds and does not own has its owner's reclaim flag set. A
        loop over the few records: a quarter of the numpy masks' time (0.7 against 2.7 us),
        which counts between every two layers of a borrower's step."""
        me = self.me
        return any(r[i, 2] == me and r[i, 1] != me and r[i, 3] != 0 for i in range(len(r)))

    # -- what a worker does --------------------------------------------------------------------

    def lend(self) -> list[int]:
        """Offer every home CPU this worker holds (it has nothing to compute): they are free for
        others to borrow. Its compute threads must be idle before it calls this. Returns them."""
        with self._locked() as r:
            mine = (r[:, 1] == self.me) & (r[:, 2] == self.me)
            r[mine, 2] = NOBODY
            r[mine, 4] += 1
            r[mine, 5] = 0
            return self._cpus(mine)

    def borrow(self, limit: int | None = None) -> list[int]:
        """Take up to `limit` free CPUs of other workers that their owners do not want back
        (all of them when None). Returns the CPUs taken."""
        with self._locked() as r:
            return self._cpus(self._take(r, limit))

    def reclaim(self) -> list[int]:
        """This worker has work again: take back its free home CPUs at once and ask borrowers
        for the rest (they give them back after their current step, `give_back`). Returns the
        home CPUs still out; call it again until that is empty."""
        with self._locked() as r:
            mine = r[:, 1] == self.me
            free = mine & (r[:, 2] == NOBODY)
            r[free, 2] = self.me
            r[free, 3] = 0
            r[free, 4] += 1
            r[free, 5] = self.pid
            out = mine & (r[:, 2] != self.me)
            r[out, 3] = 1
            return self._cpus(out)

    def give_back(self, everything: bool = False) -> list[int]:
        """Release the borrowed CPUs whose owners reclaim them (every borrowed CPU when
        `everything`: this worker has nothing left to compute on them). Call it between steps,
        with no compute thread running on them. Returns the CPUs released."""
        with self._locked() as r:
            borrowed = self._borrowed(r)
            going = borrowed if everything else borrowed & (r[:, 3] != 0)
            self._release(r, going)
            return self._cpus(going)

    def settle(self, give_back: bool, borrow: bool) -> list[int]:
        """A busy worker between two steps, under one lock: (when `give_back`) give back the
        borrowed CPUs whose owners reclaim them, then (when `borrow`) take every free CPU, and
        return the CPUs it holds now, in CPU order."""
        with self._locked() as r:
            if give_back:
                self._release(r, self._borrowed(r) & (r[:, 3] != 0))
            if borrow:
                self._take(r, None)
            return self._cpus(r[:, 2] == self.me)

    # -- changes to the locked records -----------------------------------------------------------

    def _borrowed(self, r: np.ndarray) -> np.ndarray:
        """CPUs this worker holds and does not own."""
        return (r[:, 2] == self.me) & (r[:, 1] != self.me)

    def _take(self, r: np.ndarray, limit: int | None) -> np.ndarray:
        """Hold up to `limit` (None: every) free CPU of another owner who does not want it
        back; returns their rows."""
        free = np.flatnonzero((r[:, 2] == NOBODY) & (r[:, 3] == 0) & (r[:, 1] != self.me))
        taken = free[: len(free) if limit is None else max(limit, 0)]
        r[taken, 2], r[taken, 5] = self.me, self.pid
        r[taken, 4] += 1
        return taken

    def _release(self, r: np.ndarray, going: np.ndarray) -> None:
        """Let go of the CPUs of mask `going`: free, or straight to an owner reclaiming it."""
        owners_back = going & (r[:, 3] != 0)
        r[going, 2], r[going, 5] = NOBODY, 0
        r[owners_back, 2] = r[owners_back, 1]  # a reclaiming owner gets it at once
        r[owners_back, 3] = 0
        r[going, 4] += 1

    def recover(self) -> list[int]:
        """Give back what an earlier process of this worker borrowed (a restarted worker calls
        it first), and take back home CPUs whose borrower's process is gone (it died mid-lend:
        it can never give them back). Returns the home CPUs taken back from a dead holder."""
        with self._locked() as r:
            self._release(r, self._borrowed(r))
            out = (r[:, 1] == self.me) & (r[:, 2] != self.me) & (r[:, 2] != NOBODY)
            dead = np.array([not _alive(int(pid)) for pid in r[:, 5]], dtype=bool) & out
            r[dead, 2], r[dead, 3], r[dead, 5] = self.me, 0, self.pid
            r[dead, 4] += 1
            return self._cpus(dead)


def worker_name(engine_id: str) -> str:
    """A worker's name in the ledger: its engine id without the per-process suffix that
    `pdserve serve` adds ("decode-0-<12 hex>" -> "decode-0"), so a restarted worker, a new
    engine, finds its own CPUs again."""
    stem, _, tail = engine_id.rpartition("-")
    hexdigits = set("0123456789abcdef")
    return stem if stem and len(tail) == 12 and set(tail) <= hexdigits else engine_id


def _alive(pid: int) -> bool:
    """Whether process `pid` exists (0: no process recorded, counted as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
