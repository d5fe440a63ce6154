"""A step's predicted time from its shape: one linear model per engine thread count.

DistServe (Zhong et al., OSDI 2024, section 4.1) models a prefill batch as a + b*sum(l) +
c*sum(l^2) over its prompt lengths l, and a decode step as linear in its batch size and total
context. A step of a chunked, continuously batched engine mixes both, so one model covers every
step here (seconds):

    t = a + b * prefill_tokens + c * attention + d * context + e * num_decodes + f * has_chunk
        + g * chunk_cached

- prefill_tokens: the prefill chunks' tokens (their share of the weight matmuls).
- attention: the (query, key) pairs the attention kernels compute for the prefill chunks: l^2 / 2
  for a fresh prompt of l tokens (DistServe's sum(l^2) term, halved: the causal kernel skips the
  blocks above the diagonal) and l * (cached + l) for a chunk after `cached` tokens (its masked
  kernel computes the whole rectangle). With l * (cached + l) for both, a fit on 2 threads of an
  AMX Xeon overpredicted a fresh 2,048-token prompt by 28% (895 against 646 ms) and
  underpredicted chunks after a cached prefix by 12-16% (docs/benchmarks.md, 2026-12-07).
- context: the decode rows' context (the KV each one reads) that the busiest thread of the
  paged decode-attention kernel reads, as the kernel splits it (`busiest_thread_context`):
  by rows when there is one a thread or more, else in parts of at least 256 positions. Summed
  context over min(rows, threads) fitted the kernel when it split by rows alone (a single
  2,048-token row then took twice as long per token of context as 16 rows on 2 threads).
- num_decodes: decode rows (one token each through the weights, sampling, per-row overhead).
- has_chunk: 1 when the step runs a prefill chunk. A decode-only step is bound by reading the
  weights once, a step with a chunk by its matmuls: with one intercept for both, a fit over
  both kinds misses short decode steps by ~10% (measured on SmolLM2-135M, 2 threads).
- chunk_cached: the sum over prefill chunks of their cached tokens. A chunk after a cached
  prefix reads (on the CPU, gathers) that prefix's K/V in every layer whatever its own length,
  so a short chunk late in a long prompt costs more than `attention` says: without this term a
  64-token chunk after 1,536 cached tokens took 1.19x its prediction on one thread and the live
  chunks of 2,048-token prompts beside streams 1.2-1.3x (docs/benchmarks.md, 2026-12-07).

Decode rows and prefill tokens get separate terms, not one "tokens" term: in a decode-only step
the two would be the same column, and profiles are mostly decode-only or prefill-only steps.

Torch-free: the router and `pdserve plan` load a fitted model without the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

FEATURES = (
    "fixed",
    "prefill_tokens",
    "attention",
    "context_per_thread",
    "num_decodes",
    "has_chunk",
    "chunk_cached",
)


@dataclass(frozen=True)
class StepShape:
    """What one engine step computes. `chunks`: (tokens computed, tokens already cached before
    them) per prefill chunk; `decode_contexts`: each decode row's context length (tokens)."""

    chunks: tuple[tuple[int, int], ...] = ()
    decode_contexts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if any(n < 1 or cached < 0 for n, cached in self.chunks):
            raise ValueError(f"chunks: need tokens >= 1 and cached >= 0, got {self.chunks}")
        if any(c < 1 for c in self.decode_contexts):
            raise ValueError(f"decode_contexts: need >= 1, got {self.decode_contexts}")
        if not self.chunks and not self.decode_contexts:
            raise ValueError("chunks: a step computes a prefill chunk or a decode row at least")

    def features(self, threads: int = 1) -> tuple[float, ...]:
        """The model's inputs in FEATURES order, for a step run on `threads` threads."""
        prefill_tokens = sum(n for n, _ in self.chunks)
        attention = sum(n * n / 2 if not cached else n * (cached + n) for n, cached in self.chunks)
        rows = len(self.decode_contexts)
        context = busiest_thread_context(self.decode_contexts, threads)
        cached = sum(c for _, c in self.chunks)
        return (1.0, prefill_tokens, attention, context, rows, float(bool(self.chunks)), cached)


DECODE_MIN_PART = 256  # the paged decode kernel's kMinPart (services/engine/kernels)
DECODE_PART_ALIGN = 16  # parts are whole blocks of the default block size


def busiest_thread_context(contexts: Sequence[int], threads: int) -> float:
    """Context positions (tokens) the busiest of `threads` threads reads in the C++ paged decode
    kernel for decode rows of `contexts`, split as the kernel splits them: with a row a thread or
    more, whole rows in consecutive runs (OpenMP's static schedule: the first len % threads
    threads take one row more); with fewer, parts of each row of max(DECODE_MIN_PART,
    total / (2 threads)) positions, each thread taking the next part as it finishes one
    (the dynamic schedule, taken here as the least loaded thread taking it)."""
    if not contexts:
        return 0.0
    if len(contexts) >= threads:
        base, extra = divmod(len(contexts), threads)
        loads, start = [], 0
        for t in range(threads):
            size = base + (1 if t < extra else 0)
            loads.append(sum(contexts[start : start + size]))
            start += size
        return float(max(loads))
    want = max(DECODE_MIN_PART, -(-sum(contexts) // (2 * threads)))
    part = -(-want // DECODE_PART_ALIGN) * DECODE_PART_ALIGN
    loads = [0] * threads
    for item in (min(part, c - first) for c in contexts for first in range(0, c, part)):
        loads[loads.index(min(loads))] += item
    return float(max(loads))


@dataclass(frozen=True)
class StepCost:
    """Fitted coefficients (seconds per unit of each feature, FEATURES order) for one thread
    count."""

    threads: int
    coefficients: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads: must be >= 1, got {self.threads}")
        if len(self.coefficients) != len(FEATURES):
            raise ValueError(f"coefficients: need {len(FEATURES)}, got {len(self.coefficients)}")

    def predict(self, shape: StepShape) -> float:
        """Predicted seconds of a step of `shape` (never below 0)."""
        return max(0.0, float(np.dot(self.coefficients, shape.features(self.threads))))


def fit(threads: int, shapes: Sequence[StepShape], seconds: Sequence[float]) -> StepCost:
    """Least squares of relative error over measured steps (each step weighted by 1 / its time,
    so a 5 ms decode step counts as much as a 2 s prefill). ValueError naming `shapes` when
    there are fewer steps than coefficients or the steps do not vary every feature that matters
    (a rank-deficient design)."""
    if len(shapes) != len(seconds):
        raise ValueError(f"seconds: {len(seconds)} timings for {len(shapes)} shapes")
    if any(not t > 0 for t in seconds):
        raise ValueError("seconds: every timing must be > 0")
    x = np.array([s.features(threads) for s in shapes], dtype=np.float64)
    y = np.array(seconds, dtype=np.float64)
    used = x.any(axis=0)  # a feature no step exercised (say, no decode rows) is left at 0
    if len(shapes) < int(used.sum()) or np.linalg.matrix_rank(x[:, used]) < int(used.sum()):
        raise ValueError(
            f"shapes: {len(shapes)} steps do not determine the {int(used.sum())} coefficients "
            "they exercise (vary tokens, context and batch)"
        )
    solution, *_ = np.linalg.lstsq(x[:, used] / y[:, None], np.ones_like(y), rcond=None)
    coefficients = np.zeros(len(FEATURES))
    coefficients[used] = solution
    return StepCost(threads, tuple(float(c) for c in coefficients))
