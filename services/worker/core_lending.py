"""Core lending on one node: a worker with nothing to compute lends its CPUs, a busy one borrows.

With a fixed split each phase computes on its own cores even while the other phase's cores sit
idle. Here an idle worker offers its CPUs in the node's ledger (`core_ledger.py`), a busy worker
takes the free ones at its next step boundary and widens its OpenMP team onto them, and an owner
whose work comes back reclaims its CPUs, waiting at most for the borrower's current step. TaiChi
and semi-PD move compute between the phases on GPUs the same way (SMs, or whole devices); on a
CPU node the unit is a core.

The rules that keep compute threads apart (the issue's "never two busy compute threads on one
core"): a worker's team is pinned one thread per CPU it holds (`pin_thread_team`); it computes
only after the ledger gives it those CPUs; a lender lends only once its team's threads sleep;
a borrower releases a CPU only between two decoder layers or two steps, after shrinking its team
off it (the docked thread stays asleep on that CPU and uses none of it). So an owner whose work
comes back waits one layer of the borrower's step for its CPUs (about 1/30 of a step of the
default model), and a borrower's steps need no bound: a long prompt runs in one step on the
borrowed CPUs, as fast as on a colocated engine, where a bound of 0.35 s a step had cut a
2,048-token prompt into three chunks that took 1.35x as long (docs/benchmarks.md, "A tenth
sitting").

Runs on the engine thread only (`EngineLoop`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from services.common import metrics
from services.cost_model import store
from services.cost_model.step_cost import StepCost
from services.engine import Engine
from services.engine.threads import pin_thread_team, set_thread_threads
from services.worker.core_ledger import CoreLedger, worker_name

logger = logging.getLogger(__name__)

RECLAIM_POLL_S = 0.001  # how often an owner waiting for its CPUs looks at the ledger (each look
# runs on the CPU it waits for, beside the borrower's compute: rarely)
RECLAIM_TIMEOUT_S = 10.0  # then the borrower is taken for dead (`CoreLedger.recover`)
ASLEEP_TIMEOUT_S = 0.05  # how long a lender waits for its team's threads to sleep
ASLEEP_POLL_S = 0.0002


class CoreLending:
    """One worker's side of core lending. `pin(cpus)` binds the engine thread's team one thread
    per CPU and returns the members' thread ids; `pin([])` leaves it one thread, unbound
    (`pin_team`; tests pass a fake).
    `costs`: the fitted step cost per thread count, given to the engine as its team resizes."""

    def __init__(
        self,
        ledger: CoreLedger,
        engine: Engine,
        role: str,
        pin: Callable[[list[int]], Sequence[int] | None],
        costs: Mapping[int, StepCost] | None = None,
    ) -> None:
        self.ledger = ledger
        self.engine = engine
        self.role = role
        self.costs = dict(costs or {})
        self.home = ledger.home()
        self.held: list[int] = []
        self._pin = pin
        self._team: list[int] = []  # the team's thread ids (member 0: the engine thread)
        self._borrows = False  # whether `held` has a CPU of another worker
        self._lent_at: float | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Hold this worker's own CPUs (a restarted worker first frees what its earlier process
        borrowed) and pin the team on them. Raises TimeoutError when they do not come back."""
        self.ledger.recover()
        self._reclaim()
        self._repin(self._home_first(self.ledger.held()))
        logger.info(
            "core lending on (%s): own CPUs %s; idle, this worker lends them, busy, it borrows "
            "free ones", self.ledger.path, self.home,
        )  # fmt: skip

    def close(self) -> None:
        """Return what this worker borrowed (it stops computing) and close the ledger."""
        self.ledger.give_back(everything=True)
        self.ledger.close()

    # -- the engine loop's calls ---------------------------------------------------------------

    def idle(self) -> None:
        """Nothing to compute: give back what was borrowed and lend this worker's own CPUs (once
        its team's threads sleep). Cheap when already lent."""
        if self._lent_at is not None:
            return
        self._wait_team_asleep()
        self._pin([])  # one thread: work a call runs while lent wakes no team thread
        self._team = []
        self.ledger.give_back(everything=True)
        self.ledger.lend()
        self.held = []
        self._borrows = False
        self._lent_at = time.monotonic()
        metrics.CORE_LENDS.labels(self.role).inc()
        metrics.CORES_HELD.labels(self.role).set(0)

    def reclaim(self) -> None:
        """A worker with work again: take back its own CPUs if they are lent, waiting (asleep,
        not computing) for their borrower's step to end. Call it before `before_step`."""
        if self._lent_at is not None:
            self._reclaim()
            metrics.CORE_LENT_SECONDS.labels(self.role).inc(time.monotonic() - self._lent_at)
            self._lent_at = None

    def before_step(self) -> None:
        """Between two steps of a busy worker that holds its own CPUs (`reclaim`): give back
        what owners reclaim, borrow free CPUs, and resize the team when what it holds changed
        (under the compute thread name: a team thread started here keeps it)."""
        give_back = self._borrows and self.ledger.reclaimed()
        if give_back:  # its team threads on those CPUs first stop spinning (~0.1 ms)
            self._wait_team_asleep()
        held = self._home_first(self.ledger.settle(give_back=give_back, borrow=True))
        if held != self.held:
            if len(set(held) - set(self.home)) > len(set(self.held) - set(self.home)):
                metrics.CORE_BORROWS.labels(self.role).inc()
            self._repin(held)

    def between_layers(self) -> None:
        """Mid-step, between two decoder layers (`Engine.between_layers`): give back the
        borrowed CPUs whose owners reclaim them, the team shrunk off them first, so the step's
        remaining layers run on what is left. Borrows nothing. About a microsecond when no
        owner asks (a read of the ledger's records without its lock)."""
        if not self._borrows or not self.ledger.reclaim_asked():
            return
        self._wait_team_asleep()
        held = self._home_first(self.ledger.settle(give_back=True, borrow=False))
        if held != self.held:
            self._repin(held)
            metrics.CORE_MID_STEP_RETURNS.labels(self.role).inc()

    # -- helpers -------------------------------------------------------------------------------

    def _reclaim(self) -> None:
        """Hold every own CPU again: the free ones at once, the borrowed ones after their
        borrower's step (a borrower gone for RECLAIM_TIMEOUT_S is taken for dead)."""
        started = time.monotonic()
        out = self.ledger.reclaim()
        while out:
            if time.monotonic() - started > RECLAIM_TIMEOUT_S:
                taken = self.ledger.recover()
                logger.warning("took back CPUs %s from a borrower that did not return them", taken)
                started = time.monotonic()
            time.sleep(RECLAIM_POLL_S)
            out = self.ledger.reclaim()
        metrics.CORE_RECLAIM_WAIT.labels(self.role).observe(time.monotonic() - started)

    def _home_first(self, cpus: list[int]) -> list[int]:
        """`cpus` with this worker's own first: the engine thread (team member 0) stays on its
        own CPU, and a shrinking team leaves its last members, those on borrowed CPUs, docked."""
        return sorted(cpus, key=lambda c: (c not in self.home, c))

    def _repin(self, held: list[int]) -> None:
        started = time.perf_counter()
        team = self._pin(held)
        self._team = list(team or [])
        self.held = held
        self._borrows = bool(set(held) - set(self.home))
        if self.costs:  # the team's size changed: so did its steps' cost
            self.engine.use_step_cost(self._cost(len(held)))
        metrics.CORE_REPIN_SECONDS.labels(self.role).observe(time.perf_counter() - started)
        metrics.CORES_HELD.labels(self.role).set(len(held))

    def _cost(self, threads: int) -> StepCost | None:
        """The fit at `threads`, else at the most threads below it (it predicts longer steps:
        the budget errs toward smaller chunks), else None."""
        fits = [n for n in self.costs if n <= threads]
        return self.costs[max(fits)] if fits else None

    def _wait_team_asleep(self) -> None:
        """Wait (at most ASLEEP_TIMEOUT_S) until the team's other threads sleep: a lent CPU must
        see none of this worker's compute, spin-waiting included."""
        deadline = time.monotonic() + ASLEEP_TIMEOUT_S
        members = self._team[1:]
        while members and time.monotonic() < deadline:
            if all(thread_state(tid) != "R" for tid in members):
                return
            time.sleep(ASLEEP_POLL_S)
        if members:
            logger.warning("lending CPUs while a team thread still runs (%s)", members)


class NoLending:
    """A worker without a core ledger: it computes on its own CPUs only."""

    def idle(self) -> None:
        pass

    def reclaim(self) -> None:
        pass

    def before_step(self) -> None:
        pass

    def close(self) -> None:
        pass


def thread_state(tid: int) -> str:
    """A thread of this process's scheduler state letter ("R" running or runnable, "S"
    sleeping, ...; "" when it is gone), from /proc/self/task/TID/stat."""
    try:
        stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    except OSError:
        return ""
    return stat.rpartition(")")[2].split()[0]


def pin_team(cpus: list[int]) -> Sequence[int] | None:
    """`pin_thread_team(cpus)`; with no CPUs, one thread (the engine thread, left where it
    is)."""
    if not cpus:
        set_thread_threads(1)
        return None
    return pin_thread_team(cpus)


def open_lending(path: str, engine: Engine, role: str) -> CoreLending:
    """`engine`'s lending through the ledger at `path` (its name there: `worker_name`).
    The saved fits for every thread count come along, so the step budget follows the team's
    size: a decode worker's (unless its --cost-model is off), and a prefill worker's too
    (`settle_step_cost` gave it only the saved fit at its own thread count). The engine calls
    `CoreLending.between_layers` in every step. Raises OSError when the ledger cannot be opened,
    ValueError naming core_ledger when it does not list this worker."""
    ledger = CoreLedger.open(path, worker_name(engine.config.engine_id))
    costs: dict[int, StepCost] = {}
    budget = engine.scheduler.step_budget
    if budget is not None or role == "prefill":  # a decode worker's --cost-model off holds
        try:
            costs = {c.threads: c for c in store.load(engine.cost_model_key())}
        except (OSError, ValueError) as exc:
            logger.warning("saved cost model unreadable: %s", exc)
    if budget is not None:
        costs.setdefault(len(ledger.home()), budget.cost)
    lending = CoreLending(ledger, engine, role, pin_team, costs)
    engine.between_layers(lending.between_layers)
    return lending
