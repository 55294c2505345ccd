"""Keep-alive for streams that wait: a beat whenever a stream has sent nothing for a while.

A stream can wait long before its first token (queued behind other tenants' requests, the state
store in an outage, a follower of a request still queued) or between two (a long step). Proxies
and load balancers close a connection idle for some time (often 60 s), cutting the stream, and a
server that writes nothing cannot notice that its client has gone. So each stream sends a beat
that every client ignores once `every_s` seconds pass with nothing else sent: an SSE comment line
(gateway/http/deps.py), an empty delta on gRPC (gateway/grpc_api/messages.py).

The source is read by a task of its own, so that waiting for its next item can time out without
cancelling the read itself; closing the stream cancels that task and closes the source.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncGenerator, TypeVar

T = TypeVar("T")

KEEPALIVE_S = 15.0      # the default beat: well within the 60 s idle timeout common to proxies


@dataclass(frozen=True)
class _End:
    """The source ended: with an exception to raise in the reader's place, or None."""
    error: BaseException | None = None


def with_keepalive(source: AsyncGenerator[T, None], every_s: float,
                   beat: T) -> AsyncGenerator[T, None]:
    """`source`'s items, and `beat` each time `every_s` seconds pass without one (0: never)."""
    if every_s <= 0:
        return source
    return _beating(source, every_s, beat)


async def _beating(source: AsyncGenerator[T, None], every_s: float,
                   beat: T) -> AsyncGenerator[T, None]:
    queue: asyncio.Queue = asyncio.Queue(maxsize=1)      # one item ahead: the source keeps its pace
    reader = asyncio.get_running_loop().create_task(_read(source, queue))
    try:
        while True:
            try:
                async with asyncio.timeout(every_s):
                    item = await queue.get()             # a timed-out get loses no item
            except TimeoutError:
                yield beat
                continue
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            yield item
    finally:
        reader.cancel()
        await asyncio.wait([reader])                     # the source is closed once this returns


async def _read(source: AsyncGenerator[T, None], queue: asyncio.Queue) -> None:
    try:
        async for item in source:
            await queue.put(item)
        await queue.put(_End())
    except Exception as exc:                             # raised to the reader, as if unwrapped
        await queue.put(_End(exc))
    finally:
        await source.aclose()
