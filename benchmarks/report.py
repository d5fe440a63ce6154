"""What every benchmark's JSON result carries: the command that produced it and the machine."""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch


def write_result(
    script: str, args: argparse.Namespace, threads: int, body: dict, skip: tuple[str, ...] = ()
) -> None:
    """Write {"command", "machine", **body} as JSON to `args.out` and say so.

    `command` repeats every argument except `out` and those in `skip` (hidden helper flags).
    """
    flags = " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", *skip)
    )
    result = {
        "command": f"python benchmarks/{script} {flags}",
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "threads": threads,
            "torch": torch.__version__,
        },
        **body,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
