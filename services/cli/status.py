"""`pdserve status [--url ROUTER]`: the router's workers as a table (rich).

One `Admin.ListWorkers` call to the router: each prefill and decode worker with its health as the
router sees it (healthy = new requests go there) and its GetInfo: running and waiting requests,
KV cache usage, free and pinned blocks, prefix-cache hit rate (hit tokens / looked-up tokens
since start). `--json` prints the same rows as one JSON list, for scripts.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from services import env

if TYPE_CHECKING:
    from rich.table import Table

    from services.common.pb import worker_pb2


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default="127.0.0.1:50051", help="the router's HOST:PORT (default: %(default)s)"
    )
    parser.add_argument(
        "--timeout", type=float, default=10.0, help="deadline in seconds (default: %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument(
        "--api-key",
        default=None,
        help="the router's API key (default: $PDSERVE_API_KEY), sent as a bearer token",
    )


FIGURES = (
    "running",
    "waiting",
    "kv_usage",
    "free_blocks",
    "num_blocks",
    "pinned_blocks",
    "prefix_hit_rate",
)


def rows(workers: worker_pb2.WorkerList) -> list[dict]:
    """One dict per worker: role, address, healthy, error (None when it answered), and FIGURES:
    running, waiting, kv_usage (0-1), free_blocks, num_blocks, pinned_blocks, prefix_hit_rate
    (0-1, None before any lookup); every figure None when the worker did not answer."""
    out = []
    for worker in workers.workers:
        row = {
            "role": worker.role,
            "address": worker.address,
            "healthy": worker.healthy,
            "error": worker.error or None,
            **dict.fromkeys(FIGURES),
        }
        if worker.HasField("info"):
            info = worker.info
            blocks, queries = info.num_blocks, info.prefix_cache_queries
            row.update(
                running=info.num_running,
                waiting=info.num_waiting,
                kv_usage=(blocks - info.num_free_blocks) / blocks if blocks else None,
                free_blocks=info.num_free_blocks,
                num_blocks=blocks,
                pinned_blocks=info.num_pinned_blocks,
                prefix_hit_rate=info.prefix_cache_hits / queries if queries else None,
            )
        out.append(row)
    return out


def _cell(value: object, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def table(listed: list[dict], router: str) -> Table:
    from rich.table import Table

    out = Table(title=f"pdserve workers of {router}")
    for name, justify in (
        ("role", "left"),
        ("address", "left"),
        ("health", "left"),
        ("running", "right"),
        ("waiting", "right"),
        ("KV used", "right"),
        ("free/total blocks", "right"),
        ("pinned", "right"),
        ("prefix hit rate", "right"),
        ("error", "left"),
    ):
        out.add_column(name, justify=justify, no_wrap=name != "error")  # type: ignore[arg-type]
    for row in listed:
        if row["error"]:  # the router routes there, but it did not answer just now
            health = "[red]unreachable[/]"
        else:
            health = "[green]healthy[/]" if row["healthy"] else "[red]unhealthy[/]"
        blocks = "-" if row["num_blocks"] is None else f"{row['free_blocks']} / {row['num_blocks']}"
        out.add_row(
            row["role"],
            row["address"],
            health,
            _cell(row["running"]),
            _cell(row["waiting"]),
            _cell(row["kv_usage"], "{:.1%}"),
            blocks,
            _cell(row["pinned_blocks"]),
            _cell(row["prefix_hit_rate"], "{:.1%}"),
            row["error"] or "",
        )
    return out


def main(args: argparse.Namespace) -> int:
    """Exit 0 with the table when every worker is healthy and answered, 3 when one is not (the
    table still printed), 1 when the router does not answer, 2 for a bad --url."""
    import grpc  # here, not at import: `pdserve --help` loads no grpc

    from services.common.channels import check_address
    from services.common.pb import common_pb2, worker_pb2_grpc

    check_address(args.url, "--url")
    key = args.api_key or env.api_key()
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    try:
        with grpc.insecure_channel(args.url) as channel:
            listed = worker_pb2_grpc.AdminStub(channel).ListWorkers(
                common_pb2.InfoRequest(), timeout=args.timeout, metadata=metadata
            )
    except grpc.RpcError as exc:
        print(f"pdserve: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    listed_rows = rows(listed)
    if args.json:
        print(json.dumps(listed_rows), flush=True)
    else:
        from rich.console import Console

        # A pipe gets the whole table (rich would squeeze it into 80 columns).
        Console(width=None if sys.stdout.isatty() else 160).print(table(listed_rows, args.url))
    return 0 if all(row["healthy"] and not row["error"] for row in listed_rows) else 3
