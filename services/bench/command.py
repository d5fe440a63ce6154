"""`pdserve bench serve`: flags (`vllm bench serve`'s names where it has them) and the run.

    pdserve bench serve --base-url http://127.0.0.1:8000 --request-rate 4 --num-prompts 128 \\
        --random-input-len 256 --random-output-len 64 --goodput ttft:500 tpot:50 --json out.json

`--request-rate` takes one rate or several (a sweep: `1,2,4,6,8`), `--bisect N` refines the
sweep's goodput knee with N more points, `--plot OUT.png` draws it. Without a server of its
own model the prompts are cut with `--tokenizer` (a model folder or name pdserve knows).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from typing import Any

from services.bench import report
from services.bench.backends import Send, Target, grpc_sender, http_sender, objective_headers
from services.bench.dataset import BenchRequest, Lengths, make_requests
from services.bench.stats import Slo
from services.bench.sweep import Point, goodput, run_point, sweep
from services.cpu import cpu_info


def _rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--request-rate: expected a rate or a comma list, got {text!r}") from None
    if not rates or not all(r > 0 for r in rates):
        raise ValueError(f"--request-rate: every rate must be > 0, got {text!r}")
    return rates


def _tokenizer(name: str) -> Any:
    from services.engine.loader import resolve_model
    from services.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(resolve_model(name))
    if tokenizer is None:
        raise ValueError(f"--tokenizer: {name!r} has no tokenizer")
    return tokenizer


def _lengths(args: argparse.Namespace) -> Lengths:
    """What the flags ask for. ValueError naming --mix."""
    return Lengths(
        args.dataset_name,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        args.random_prefix_len,
        Lengths.parse_mix(args.mix) if args.mix else (),
    )


async def _run(
    args: argparse.Namespace, slo: Slo, rates: list[float], lengths: Lengths
) -> list[Point]:
    tokenizer = _tokenizer(args.tokenizer or args.model)

    def prompts(count: int) -> list[BenchRequest]:  # fresh tags: nothing cached across points
        return make_requests(tokenizer.encode, tokenizer.decode, count, lengths, args.seed)

    target = Target(
        args.base_url,
        args.grpc,
        args.model,
        args.api_key,
        args.ignore_eos,
        objectives=slo if args.slo_headers else None,
    )
    async with _connection(target) as send:
        if args.num_warmups:
            await run_point(send, prompts(args.num_warmups), math.inf, slo, progress=False)

        async def point(rate: float) -> Point:
            return await run_point(
                send,
                prompts(args.num_prompts),
                rate,
                slo,
                args.burstiness,
                args.max_concurrency,
                args.seed,
                progress=not args.no_progress,
            )

        return await sweep(point, rates, args.bisect)


class _connection:
    """The client session (HTTP) or channel (gRPC) of a run, as an async context giving `send`."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self._close: Any = None

    async def __aenter__(self) -> Send:
        if self.target.base_url is not None:
            import aiohttp

            session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.target.timeout_s),
                connector=aiohttp.TCPConnector(limit=0),
            )
            self._close = session.close
            return http_sender(self.target, session)
        import grpc

        channel = grpc.aio.insecure_channel(self.target.grpc)  # type: ignore[arg-type]
        self._close = channel.close
        return grpc_sender(self.target, channel)

    async def __aexit__(self, *exc: object) -> None:
        await self._close()


def _check_flags(args: argparse.Namespace, slo: Slo) -> None:
    """Raises ValueError naming the first flag out of range."""
    for flag, value, low in (
        ("--num-prompts", args.num_prompts, 1),
        ("--random-input-len", args.random_input_len, 1),
        ("--random-output-len", args.random_output_len, 1),
        ("--random-prefix-len", args.random_prefix_len, 0),
        ("--num-warmups", args.num_warmups, 0),
        ("--bisect", args.bisect, 0),
    ):
        if value < low:
            raise ValueError(f"{flag}: must be >= {low}, got {value}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency: must be >= 1, got {args.max_concurrency}")
    if args.slo_headers and not objective_headers(slo, args.random_input_len):
        raise ValueError("--slo-headers: needs a ttft, tpot or itl objective in --goodput")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio: must be in [0, 1), got {args.random_range_ratio}")


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark; prints the table, writes the JSON and plot asked for."""
    slo, rates = Slo.parse(args.goodput), _rates(args.request_rate)
    _check_flags(args, slo)
    points = asyncio.run(_run(args, slo, rates, _lengths(args)))
    found = goodput([p.stats for p in points])
    report.print_points([p.stats for p in points], found)
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "func")}
    config["machine"] = machine()
    data = report.run_json(config, points, found)
    if args.json:
        report.write_json(args.json, data)
    if args.plot:
        report.plot({args.base_url or args.grpc: data}, args.plot)
    cached = sum(1 for p in points for r in p.results if r.cached_tokens)
    if cached:
        print(f"warning: {cached} requests got prompt tokens from a prefix cache", file=sys.stderr)
    return 0


def machine() -> dict[str, Any]:
    """What the figures were measured on: CPU model, CPUs this process may use, load average."""
    return {
        "cpu_model": cpu_info().get("model name", ""),
        "cpus": len(os.sched_getaffinity(0)),
        "load_average": os.getloadavg(),
    }
