"""Running the (blocking) request flow for the asyncio HTTP server.

`GenerateFlow` is synchronous: it blocks on gRPC calls to the workers. The HTTP server is an
event loop. Each admitted sequence runs its flow on a thread of one pool (the admission gate
bounds how many run at once), and its items cross to the event loop with
`call_soon_threadsafe`: one wake-up per item, a few microseconds. The thread also does the
per-token work that needs the tokenizer (rendering log-probabilities), so the event loop only
writes bytes. Stalled or idle connections hold no thread: only admitted sequences do.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TypeVar

from services.common.thread_pool import ElasticThreadPool

T = TypeVar("T")
_END = object()


class FlowThreads:
    """A pool of at most `max_threads` threads that iterate flows for the event loop (idle ones
    exit after a few seconds)."""

    def __init__(self, max_threads: int) -> None:
        self._executor = ElasticThreadPool(max_threads, thread_name_prefix="http-flow")

    async def merged(self, sources: Sequence[Iterator[T]]) -> AsyncIterator[tuple[int, T]]:
        """(index of the source, item) for every item of every source, each source iterated on
        its own pool thread, in the order they arrive; re-raises the first error.

        Closing this iterator early does not stop the threads: the caller stops a flow by
        cancelling its `CancelScope` (its thread then ends with the flow's cancel error).
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, object, BaseException | None]] = asyncio.Queue()

        def put(index: int, item: object, error: BaseException | None = None) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (index, item, error))
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

        def pump(index: int, source: Iterator[T]) -> None:
            try:
                for item in source:
                    put(index, item)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                put(index, None, exc)
            else:
                put(index, _END)

        for index, source in enumerate(sources):
            self._executor.submit(pump, index, source)
        running = len(sources)
        while running:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is _END:
                running -= 1
                continue
            yield index, item  # type: ignore[misc]

    async def run(self, sources: Sequence[Iterator[T]]) -> list[list[T]]:
        """Every item of every source, per source (iterated as `merged` does)."""
        out: list[list[T]] = [[] for _ in sources]
        async for index, item in self.merged(sources):
            out[index].append(item)
        return out

    def close(self) -> None:
        """Waits for running flows to end (their requests must have been cancelled first)."""
        self._executor.shutdown(wait=True)
