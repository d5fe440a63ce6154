"""Fitted step costs on disk: one JSON file per machine, dtype and model, one entry per thread
count, under `$PDSERVE_CACHE_DIR/cost_models/` (`pdserve profile` writes it, workers and the
planner read it)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from services.cost_model.step_cost import FEATURES, StepCost
from services.cpu import cpu_info
from services.env import cache_dir

FORMAT = 6  # 2: context per thread; 3: a chunk's cached tokens; 4: a fresh prompt's attention
# halved (step_cost.FEATURES); 5: bfloat16 prefill attention blocked on CPUs without AMX (its
# steps' costs changed, so fits from before it are stale); 6: decode attention split over a
# row's context (the context feature follows the kernel's split)


@functools.cache  # the CPU does not change under a running process
def machine_id() -> str:
    """This machine's CPU as the cost model knows it: the model name and a digest of the CPU
    flags (a model fitted on an AVX-512 CPU says nothing of an AVX2-only one)."""
    fields = cpu_info()
    name = fields.get("model name") or platform.processor() or platform.machine()
    flags = " ".join(sorted(fields.get("flags", "").split()))
    return f"{name}|{hashlib.sha256(flags.encode()).hexdigest()[:12]}"


@dataclass(frozen=True)
class CostModelKey:
    """What a fitted model is valid for: the device (`machine_id()` or a GPU's name), the
    dtype's name ("float32", "bfloat16") and the model (its folder's name or id)."""

    device: str
    dtype: str
    model: str

    def path(self, root: Path | None = None) -> Path:
        """The file of this key (its name a digest of the key; the key is inside too)."""
        text = json.dumps([self.device, self.dtype, self.model])
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        return (root or cache_dir() / "cost_models") / f"{digest}.json"


def save(key: CostModelKey, costs: list[StepCost], root: Path | None = None) -> Path:
    """Writes `costs` (one per thread count; an existing file's other thread counts are kept)
    atomically; returns the path."""
    try:
        kept = load(key, root)
    except ValueError:  # unreadable or another format: the new fit replaces it
        kept = []
    merged = {c.threads: c for c in kept} | {c.threads: c for c in costs}
    path = key.path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "format": FORMAT,
        "key": {"device": key.device, "dtype": key.dtype, "model": key.model},
        "features": list(FEATURES),
        "threads": {str(t): list(c.coefficients) for t, c in sorted(merged.items())},
    }
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body, indent=1))
    tmp.replace(path)
    return path


def load(key: CostModelKey, root: Path | None = None) -> list[StepCost]:
    """The saved step costs of `key`, by thread count ([] when there is no file). ValueError
    naming `cost_model` for a file of another format, key or feature set."""
    path = key.path(root)
    if not path.exists():
        return []
    try:
        body = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(
            f"cost_model: {path} is not JSON ({exc}): `pdserve profile` rewrites it"
        ) from None
    expected = {"device": key.device, "dtype": key.dtype, "model": key.model}
    if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("key") != expected:
        raise ValueError(
            f"cost_model: {path} is not a format-{FORMAT} model of {expected}: `pdserve profile` "
            "rewrites it"
        )
    if body.get("features") != list(FEATURES):
        raise ValueError(f"cost_model: {path} was fitted on features {body.get('features')}")
    return [
        StepCost(t, tuple(c)) for t, c in sorted((int(t), c) for t, c in body["threads"].items())
    ]


def to_json(costs: list[StepCost]) -> str:
    """`costs` as the compact JSON a worker reports in `WorkerInfo.step_costs_json` ("" for
    none): {"features": [...], "threads": {"N": [coefficients]}}."""
    if not costs:
        return ""
    threads = {str(c.threads): list(c.coefficients) for c in sorted(costs, key=lambda c: c.threads)}
    return json.dumps({"features": list(FEATURES), "threads": threads}, separators=(",", ":"))


def from_json(text: str) -> dict[int, StepCost]:
    """The step costs by thread count of a `to_json` text ({} for ""). ValueError naming
    `step_costs_json` for malformed text or another feature set."""
    if not text:
        return {}
    try:
        body = json.loads(text)
        if body["features"] != list(FEATURES):
            raise ValueError(f"fitted on features {body['features']}, not {list(FEATURES)}")
        costs = [StepCost(int(t), tuple(float(x) for x in c)) for t, c in body["threads"].items()]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"step_costs_json: {exc}") from None
    return {c.threads: c for c in costs}
