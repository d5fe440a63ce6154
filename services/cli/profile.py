"""`pdserve profile`: fit the step cost model on this machine (`services/cost_model/profile.py`)
and save it; `--check STEP_LOG` scores the saved model on steps a worker logged while serving.

Needs only torch and transformers (no servers), so it also runs on a bare GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from services.cli.run import RUN_EXCLUDE
from services.engine.config import EngineConfig
from services.flags import add_config_flags, config_from_args


def add_profile(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser, EngineConfig, exclude=RUN_EXCLUDE | {"max_num_batched_tokens"})
    parser.add_argument(
        "--threads",
        default=None,
        metavar="N[,N...]",
        help="thread counts to profile (default: 1 and every CPU this process may use)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the small sweep a worker runs when it finds no saved model (well under 60 s)",
    )
    parser.add_argument(
        "--check",
        default=None,
        metavar="STEP_LOG",
        help="do not profile: print the saved model's error on the steps a worker logged "
        "(`--step-log`) while serving",
    )
    parser.add_argument("--json", default=None, metavar="OUT", help="also write the results here")


def _threads(text: str | None) -> list[int]:
    available = len(os.sched_getaffinity(0))
    if text is None:
        return sorted({1, available})
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--threads: expected counts like 1,2, got {text!r}") from None


def profile(args: argparse.Namespace) -> int:
    """`pdserve profile`: prints one line per thread count (coefficients, the fit's error on its
    own sweep) and where the model was saved."""
    from services.cost_model import profile as sweep
    from services.cost_model import step_log, store
    from services.cost_model.step_cost import FEATURES
    from services.engine import Engine

    config = config_from_args(args, EngineConfig)
    threads = sweep.check_threads(_threads(args.threads), len(os.sched_getaffinity(0)))
    records = None
    if args.check is not None:  # read before loading the model: a bad path fails at once
        try:
            records = step_log.read(args.check)
        except OSError as exc:
            raise ValueError(f"--check: cannot read {args.check}: {exc.strerror}") from None
        except ValueError as exc:
            raise ValueError(f"--check: {exc}") from None
        if not records:
            raise ValueError(f"--check: {args.check} holds no step")
    engine = Engine(config)
    key = engine.cost_model_key()
    if records is not None:
        costs = store.load(key)
        if not costs:
            raise ValueError(
                f"--check: no saved model for {key.dtype} {key.model} here ({key.path()}): "
                "check with the worker's --dtype, or run `pdserve profile` first"
            )
        errors = step_log.prediction_errors(records, costs)
        for e in errors:
            kinds = ", ".join(f"{k} {n} steps {m:.1f}%" for k, (n, m) in e.by_kind.items())
            print(
                f"{e.threads} thread(s): {e.num_steps} steps, |error| median {e.median_pct:.1f}% "
                f"p90 {e.p90_pct:.1f}% ({kinds})"
            )
        if not errors:
            saved = sorted(c.threads for c in costs)
            print(f"no logged step ran at a thread count with a saved model (saved: {saved})")
        _write_json(args.json, {"key": vars(key), "errors": [vars(e) for e in errors]})
        return 0 if errors else 1
    engine.warm_up()
    results = sweep.profile(engine, threads, sweep.QUICK if args.quick else sweep.FULL)
    path = store.save(key, [r.cost for r in results])
    rows = []
    for r in results:
        fit_errors = sorted(100 * e for e in r.errors())
        p90 = fit_errors[min(len(fit_errors) - 1, int(0.9 * len(fit_errors)))]
        coefficients = dict(zip(FEATURES, r.cost.coefficients, strict=True))
        print(
            f"{r.cost.threads} thread(s): {len(r.probes)} shapes, fit |error| median "
            f"{statistics.median(fit_errors):.1f}% p90 {p90:.1f}%; "
            + " ".join(f"{name}={value:.3g}" for name, value in coefficients.items())
        )
        probes = [
            {"chunks": p.shape.chunks, "decode_contexts": p.shape.decode_contexts, "s": p.seconds}
            for p in r.probes
        ]
        rows.append({"threads": r.cost.threads, "coefficients": coefficients, "probes": probes})
    print(f"saved: {path}")
    _write_json(args.json, {"key": vars(key), "saved": str(path), "threads": rows})
    return 0


def _write_json(path: str | None, body: dict) -> None:
    if path is not None:
        with open(path, "w", encoding="utf-8") as out:
            json.dump(body, out, indent=1)
