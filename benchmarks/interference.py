"""The interference run: what long prompts do to running streams.

`streams` steady streams (closed loop: each sends its next request when the last one ends) of
`stream_prompt`-token prompts and `stream_output` output tokens run for `seconds` alone, then
for `seconds` again while a `long_prompt`-token prompt with `long_output` output tokens arrives
every `long_every` seconds. Reported: the streams' ITL p99 (every gap between streamed chunks)
and TPOT p50 in each phase, and the long prompts' TTFT. Over any OpenAI-compatible server.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from services.bench.backends import Target, http_sender
from services.bench.dataset import Lengths, make_requests
from services.bench.stats import RequestResult, summarize


async def phase(
    send, tokenizer, seconds: float, streams: int, lengths: Lengths, long: Lengths | None,
    long_every: float, seed: int,
) -> tuple[list[RequestResult], list[RequestResult]]:  # fmt: skip
    """(the streams' results, the long prompts' results) of one phase."""
    end = time.perf_counter() + seconds
    stream_results: list[RequestResult] = []
    long_sends: list[asyncio.Task] = []

    # Prompts made before the clock starts: cutting them costs the generator CPU time.
    steady = iter(make_requests(tokenizer.encode, tokenizer.decode, 32 * streams, lengths, seed))
    heavy = iter(
        make_requests(tokenizer.encode, tokenizer.decode, int(seconds / long_every) + 2, long, seed)
        if long is not None
        else []
    )

    async def stream() -> None:
        while time.perf_counter() < end:
            stream_results.append(await send(next(steady)))

    async def longs() -> None:
        while long is not None and time.perf_counter() < end:
            long_sends.append(asyncio.ensure_future(send(next(heavy))))
            await asyncio.sleep(long_every)

    await asyncio.gather(*(stream() for _ in range(streams)), longs())
    return stream_results, list(await asyncio.gather(*long_sends))


def figures(results: list[RequestResult]) -> dict[str, Any]:
    done = [r for r in results if r.complete]
    itl = summarize([g for r in done for g in r.itl])
    tpot = summarize([t for r in done if (t := r.tpot) is not None])
    return {
        "requests": len(results),
        "complete": len(done),
        "itl_p99_ms": itl.p99 * 1e3 if itl else None,
        "itl_p99_is_max": itl.p99_is_max if itl else None,
        "itl_samples": itl.count if itl else 0,
        "tpot_p50_ms": tpot.p50 * 1e3 if tpot else None,
    }


async def interference(
    url: str,
    model: str,
    tokenizer: Any,
    seconds: float,
    streams: int = 4,
    stream_prompt: int = 128,
    stream_output: int = 256,
    long_prompt: int = 2048,
    long_output: int = 8,
    long_every: float = 3.0,
) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        send = http_sender(Target(base_url=url, model=model), session)
        steady = Lengths("random", stream_prompt, stream_output)
        alone, _ = await phase(send, tokenizer, seconds, streams, steady, None, long_every, 1)
        mixed, longs = await phase(
            send,
            tokenizer,
            seconds,
            streams,
            steady,
            Lengths("random", long_prompt, long_output),
            long_every,
            2,  # noqa: E501
        )
    long_ttft = summarize([r.ttft for r in longs if r.complete])
    return {
        "alone": figures(alone),
        "with_long_prompts": figures(mixed),
        "long_prompts": len(longs),
        "long_ttft_p50_ms": long_ttft.p50 * 1e3 if long_ttft else None,
        "long_ttft_mean_ms": long_ttft.mean * 1e3 if long_ttft else None,
        "long_failed": sum(1 for r in longs if not r.complete),
    }
