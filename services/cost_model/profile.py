"""`pdserve profile`: time engine steps of known shapes on this machine and fit the step cost.

The one module of this package that loads the engine (and torch); the rest stays torch-free.

Each probe is one step built by hand, as the engine's warm-up builds its dummy forward
(`services/engine/warmup.py`): a `SchedulerOutput` over blocks borrowed from the pool, run
through the engine's `ModelRunner` (the forward and the sampling of a real step). So a decode
batch of 32 rows at 2,048 tokens of context costs no prefill to set up, every row reads its own
blocks (shared blocks would sit in the CPU's cache and time too fast), and each step has exactly
the shape it is recorded with. KV values are whatever the blocks hold: step time does not depend
on them. What a probe leaves out is the scheduler's own bookkeeping, well under a millisecond a
step; `check` measures the model against steps logged while serving, which include it.

Per thread count (`torch.set_num_threads`), the sweep times prefill chunks (tokens x cached
context), decode batches (rows x context) and mixed steps (decode rows plus one chunk), each
`repeats` times after one untimed run, and fits `step_cost.fit` on the medians.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from services.cost_model.step_cost import StepCost, StepShape, fit
from services.engine import Engine
from services.engine.sampler import SamplingRow
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass(frozen=True)
class Grid:
    """The probes of one sweep: prefill chunks (tokens, cached), decode batches (rows,
    context) and mixed steps (rows, context, chunk tokens, chunk's cached tokens)."""

    prefill: tuple[tuple[int, int], ...]
    decode: tuple[tuple[int, int], ...]
    mixed: tuple[tuple[int, int, int, int], ...]
    repeats: int

    def shapes(self, max_model_len: int) -> list[StepShape]:
        """The probes' shapes, those longer than `max_model_len` left out."""
        shapes = [StepShape(chunks=((n, c),)) for n, c in self.prefill if n + c <= max_model_len]
        shapes += [
            StepShape(decode_contexts=(ctx,) * b) for b, ctx in self.decode if ctx <= max_model_len
        ]
        shapes += [
            StepShape(chunks=((n, cached),), decode_contexts=(ctx,) * b)
            for b, ctx, n, cached in self.mixed
            if max(ctx, n + cached) <= max_model_len
        ]
        return shapes


# Quick: what a worker can afford at start-up (well under 60 s for two thread counts of a
# 135M model in float32 on one core); full: up to 2,048-token chunks and 64 rows.
QUICK = Grid(
    prefill=((16, 0), (128, 0), (512, 0), (32, 1024), (256, 512)),
    decode=((1, 128), (1, 2048), (4, 1024), (16, 256), (16, 1024)),
    mixed=((4, 512, 64, 0), (8, 256, 128, 0), (4, 1024, 64, 1024)),
    repeats=2,
)
FULL = Grid(
    prefill=tuple(
        (n, c) for n in (16, 64, 128, 256, 512, 1024, 2048) for c in (0, 256, 1024) if n + c <= 3072
    ),
    decode=tuple((b, ctx) for b in (1, 2, 4, 8, 16, 32, 64) for ctx in (64, 256, 1024, 2048)),
    mixed=(
        (2, 1024, 256, 0),
        (4, 512, 64, 0),
        (8, 256, 128, 0),
        (16, 512, 512, 0),
        (32, 256, 32, 0),
        (4, 1024, 64, 1536),
        (4, 256, 160, 1024),
        (8, 512, 32, 2048),
    ),  # fmt: skip
    repeats=3,
)


@dataclass(frozen=True)
class Probe:
    """One timed shape: `seconds` is the median of its timed runs."""

    shape: StepShape
    seconds: float


@dataclass(frozen=True)
class ThreadsProfile:
    """The probes timed at one thread count and the model fitted on them."""

    cost: StepCost
    probes: tuple[Probe, ...]

    def errors(self) -> list[float]:
        """|predicted - measured| / measured of every probe (the fit's own sweep)."""
        return [abs(self.cost.predict(p.shape) - p.seconds) / p.seconds for p in self.probes]


def check_threads(threads: Sequence[int], available: int) -> tuple[int, ...]:
    """`threads` sorted and unique, each in [1, available]. ValueError naming --threads."""
    if not threads or any(t < 1 or t > available for t in threads):
        raise ValueError(
            f"--threads: each thread count must be in [1, {available}] (the CPUs this process "
            f"may use), got {list(threads)}"
        )
    return tuple(sorted(set(threads)))


def profile(engine: Engine, threads: Sequence[int], grid: Grid = QUICK) -> list[ThreadsProfile]:
    """Time `grid`'s probes on `engine` at each thread count and fit one `StepCost` each.
    Leaves torch's thread count as it found it. Probes longer than the model or larger than
    the free KV blocks are left out; ValueError naming `shapes` when too few are left to fit."""
    free = engine.kv_cache.pool.num_free_blocks
    shapes = [
        s for s in grid.shapes(engine.scheduler.max_model_len)
        if _num_blocks(s, engine.kv_cache.spec.block_size) <= free
    ]  # fmt: skip
    before = torch.get_num_threads()
    results = []
    try:
        for count in threads:
            torch.set_num_threads(count)
            started = time.perf_counter()
            probes = [Probe(shape, _time_step(engine, shape, grid.repeats)) for shape in shapes]
            cost = fit(count, [p.shape for p in probes], [p.seconds for p in probes])
            results.append(ThreadsProfile(cost, tuple(probes)))
            logger.info(
                "profile: %d thread(s): %d shapes in %.1f s", count, len(probes),
                time.perf_counter() - started,
            )  # fmt: skip
    finally:
        torch.set_num_threads(before)
    return results


def blocks_needed(engine: Engine, grid: Grid) -> int:
    """KV blocks the largest probe of `grid` that fits the model borrows."""
    shapes = grid.shapes(engine.scheduler.max_model_len)
    return max(_num_blocks(s, engine.kv_cache.spec.block_size) for s in shapes)


def _rows(shape: StepShape) -> list[tuple[int, int]]:
    """(tokens, start position) of each row: chunks after their cached tokens, then decodes."""
    return [*shape.chunks, *((1, ctx - 1) for ctx in shape.decode_contexts)]


def _blocks_per_row(shape: StepShape, block_size: int) -> list[int]:
    return [math.ceil((n + start) / block_size) for n, start in _rows(shape)]


def _num_blocks(shape: StepShape, block_size: int) -> int:
    return sum(_blocks_per_row(shape, block_size))


def _time_step(engine: Engine, shape: StepShape, repeats: int) -> float:
    """Median seconds of `repeats` runs of a hand-built step of `shape` (after one untimed)."""
    with _step_of(engine, shape) as step:
        timings = []
        for i in range(repeats + 1):
            started = time.perf_counter()
            engine.runner.execute(step)
            if i:
                timings.append(time.perf_counter() - started)
    return statistics.median(timings)


@contextmanager
def _step_of(engine: Engine, shape: StepShape) -> Iterator[SchedulerOutput]:
    """A `SchedulerOutput` of `shape` over borrowed blocks: each chunk's row computes its
    tokens after its cached ones; each decode row computes one token at the end of its
    context. Every row samples greedily."""
    block_size = engine.kv_cache.spec.block_size
    rows = _rows(shape)
    needed = _blocks_per_row(shape, block_size)
    with engine.kv_cache.pool.borrow(sum(needed)) as block_ids:
        scheduled, offset = [], 0
        for i, ((n, start), count) in enumerate(zip(rows, needed, strict=True)):
            table = block_ids[offset : offset + count]
            offset += count
            row = SamplingRow(_GREEDY, seed=0, output_index=0)
            tokens = [(i * 7919 + j) % engine.runner.vocab_size for j in range(n)]
            scheduled.append(ScheduledRequest(f"probe-{i}", tokens, start, table, row))
        yield SchedulerOutput(scheduled=scheduled)
