"""A worker's step cost: the model `pdserve profile` saved for its machine, dtype, model and
thread count, which sizes the prompt chunks of its mixed steps (`engine/step_budget.py`)."""

from __future__ import annotations

import logging

from services.cost_model import store
from services.cost_model.step_cost import StepCost
from services.engine import Engine

logger = logging.getLogger(__name__)


def load_step_cost(engine: Engine, threads: int) -> StepCost | None:
    """The saved step cost of `engine` at `threads` threads, given to the engine; None (logged:
    then only --max-num-batched-tokens caps a mixed step) when there is none or it is
    unreadable."""
    key = engine.cost_model_key()
    try:
        costs = store.load(key)
    except (OSError, ValueError) as exc:
        logger.warning("cost model unreadable (%s): fit it again with `pdserve profile`", exc)
        costs = []
    cost = next((c for c in costs if c.threads == threads), None)
    if cost is None:
        logger.warning(
            "no cost model for %d thread(s) of %s here (%s): mixed steps are capped by "
            "--max-num-batched-tokens only; `pdserve profile` fits one",
            threads, key.model, key.path(),
        )  # fmt: skip
    else:
        logger.info(
            "cost model for %d thread(s): mixed steps keep the running streams' ITL objective "
            "(default %g ms)", threads, engine.config.slo_itl_ms,
        )  # fmt: skip
    engine.use_step_cost(cost)
    return cost
