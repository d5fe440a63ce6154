"""A worker's step cost: the model `pdserve profile` saved for its machine, dtype, model and
thread count. A decode worker sizes the prompt chunks of its mixed steps by it, and every worker
decides by it which queued prompts share a step (`engine/step_budget.py`). A prefill worker
takes the saved model only (mode "saved"): it has no mixed steps to size, so no start-up profile.

`--cost-model auto` (the default): the saved model, else a quick profile run once on the engine
thread before the worker turns SERVING (`services/cost_model/profile.py`, QUICK: well under 60 s
for the default model; workers that start together wait for one another's under a file lock
and reuse it). `saved`: the saved model only. `off`: none. Without a model a mixed step is
capped by --max-num-batched-tokens alone, and the worker logs so.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from services.cost_model import store
from services.cost_model.step_cost import StepCost
from services.engine import Engine
from services.engine.config import EngineRole
from services.engine.file_lock import file_lock

logger = logging.getLogger(__name__)
_reported: dict[Path, tuple[int, str]] = {}  # cost file -> (its mtime_ns, its JSON) as last read


def settle_step_cost(engine: Engine, threads: int, mode: str = "auto") -> StepCost | None:
    """Find (or, with mode "auto", fit and save) `engine`'s step cost at `threads` threads and
    give it to the engine. Run it on the engine thread: a profile times that thread's steps.
    Returns it, or None (logged) when there is none."""
    if mode == "off":
        logger.info(
            "cost model off (--cost-model off): mixed steps are capped by "
            "--max-num-batched-tokens only; ITL objectives do not size them"
        )
        engine.use_step_cost(None)
        return None
    key = engine.cost_model_key()
    cost = _saved(key, threads)
    if cost is None and mode == "auto":
        path = key.path()
        path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(path.with_suffix(".lock")):
            cost = _saved(key, threads) or _profile(engine, key, threads)
    prefill = engine.config.role == EngineRole.PREFILL
    if cost is None:
        logger.log(
            logging.INFO if prefill else logging.WARNING,
            "no cost model for %d thread(s) of %s here (%s): %s are capped by "
            "--max-num-batched-tokens only; `pdserve profile` fits one",
            threads, key.model, key.path(), "steps" if prefill else "mixed steps",
        )  # fmt: skip
    elif prefill:
        logger.info(
            "cost model for %d thread(s): queued prompts share a step only where that lowers "
            "their TTFT", threads,
        )  # fmt: skip
    else:
        itl_ms = engine.config.slo_itl_ms
        logger.info(
            "cost model for %d thread(s): mixed steps keep the running streams' ITL objective "
            "(default %s)", threads,
            f"{itl_ms:g} ms" if itl_ms is not None else "5x their predicted decode step",
        )  # fmt: skip
    engine.use_step_cost(cost)
    return cost


def _saved(key: store.CostModelKey, threads: int) -> StepCost | None:
    try:
        costs = store.load(key)
    except (OSError, ValueError) as exc:
        logger.warning("saved cost model unreadable: %s", exc)
        return None
    return next((c for c in costs if c.threads == threads), None)


def _profile(engine: Engine, key: store.CostModelKey, threads: int) -> StepCost | None:
    from services.cost_model import profile

    needed, free = (
        profile.blocks_needed(engine, profile.QUICK),
        engine.kv_cache.pool.num_free_blocks,
    )
    if needed > free:  # a small test cache: profiling part of the sweep would fit badly
        logger.warning(
            "no quick profile: its largest step needs %d KV blocks, this worker has %d "
            "(`pdserve profile` fits the model on a larger cache)", needed, free,
        )  # fmt: skip
        return None
    started = time.perf_counter()
    (result,) = profile.profile(engine, [threads], profile.QUICK)
    store.save(key, [result.cost])
    logger.info(
        "fitted the step cost model for %d thread(s) in %.1f s (once; `pdserve profile` fits "
        "the full sweep)", threads, time.perf_counter() - started,
    )  # fmt: skip
    return result.cost


def saved_costs_json(engine: Engine) -> str:
    """The step costs saved for `engine`'s machine, dtype and model, every thread count, as
    `WorkerInfo.step_costs_json` reports them ("" when none or unreadable); the file is read
    again only when it changed (GetInfo asks every health check)."""
    key = engine.cost_model_key()
    path = key.path()
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        return ""
    cached = _reported.get(path)
    if cached is None or cached[0] != stamp:
        try:
            text = store.to_json(store.load(key))
        except (OSError, ValueError):
            text = ""
        cached = _reported[path] = (stamp, text)
    return cached[1]
