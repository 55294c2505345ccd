"""`n` > 1: a request for n choices runs as n requests through the scheduler, one per choice.

Each choice is its own request (its own place in the batch, its own KV, its own RNG), so choices
need nothing new below the gateway: with a seed, choice i samples with seed + i (the choices
differ under sampling and each is reproducible on its own); without one, each draws its own.
The prompt's KV is shared where the prefix cache has it (blocks keyed by tenant and tokens).
Every choice is admitted and charged like a request of its own (rate limits, TPM, the tenant's
concurrency), all or none: a refused choice closes the ones admitted before it. Closing the
streams (a client gone) cancels every choice.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Protocol, Sequence

from gateway import errors
from gateway.errors import ApiError
from gateway.service import EventStream, GenerateInput, GenerateOutput, StreamChunk


class Opener(Protocol):
    """What the routers call: `GenerationService`, or Ray mode's `RemoteService`."""
    async def open_stream(self, inp: GenerateInput) -> EventStream: ...

    async def generate(self, inp: GenerateInput) -> GenerateOutput: ...


def check_choices(n: int, most: int) -> None:
    if not 1 <= n <= most:
        raise errors.invalid(f"n must be an integer in [1, {most}], got {n}", "n")


def choice_input(inp: GenerateInput, i: int) -> GenerateInput:
    """Choice i's input: seed + i (wrapping within the 64-bit range seeds may take)."""
    if i == 0 or inp.seed is None or not isinstance(inp.seed, int):
        return inp
    seed = inp.seed + i
    return dataclasses.replace(inp, seed=seed - 2**64 if seed >= 2**64 else seed)


async def open_choices(service: Opener, inp: GenerateInput, n: int) -> list[EventStream]:
    """Admit the n choices (raises ApiError, with none of them left running, if one is refused).

    Choice 0 goes first, and the others only once it has sent its first event: its prompt's KV
    is then computed and in the prefix cache, so the other choices find it there instead of
    each computing it in the same steps (one prefill for the n; admitted together, every choice
    would prefill the prompt beside the others)."""
    streams: list[EventStream] = []
    try:
        streams.append(await service.open_stream(choice_input(inp, 0)))
        if n > 1:
            streams[0] = await _ReadAhead.first_of(streams[0])
        for i in range(1, n):
            streams.append(await service.open_stream(choice_input(inp, i)))
    except BaseException:
        for s in streams:
            await s.aclose()
        raise
    return streams


class _ReadAhead:
    """A stream whose first item has been read (to know its prefill is done), then replayed."""

    def __init__(self, stream: EventStream, items: list) -> None:
        self.stream, self.request_id, self._items = stream, stream.request_id, items
        self.service_tier = stream.service_tier

    @classmethod
    async def first_of(cls, stream: EventStream) -> "_ReadAhead":
        it = stream.__aiter__()
        try:
            return cls(stream, [await it.__anext__()])
        except StopAsyncIteration:
            return cls(stream, [])

    async def __aiter__(self) -> AsyncIterator[StreamChunk | GenerateOutput]:
        for item in self._items:
            yield item
        if self._items and isinstance(self._items[-1], GenerateOutput):
            return
        async for item in self.stream:
            yield item

    async def aclose(self) -> None:
        await self.stream.aclose()


async def generate_choices(service: Opener, inp: GenerateInput, n: int) -> list[GenerateOutput]:
    """Each choice's output, in choice order; cancelling this cancels every choice."""
    if n == 1:
        return [await service.generate(inp)]       # one call (one round trip in Ray mode)
    streams = await open_choices(service, inp, n)
    try:
        return list(await asyncio.gather(*(_output(s) for s in streams)))
    finally:
        for s in streams:
            await s.aclose()


async def _output(stream: EventStream) -> GenerateOutput:
    async for item in stream:
        if isinstance(item, GenerateOutput):
            if item.finish_reason == "error":
                raise ApiError(500, "generation failed; retry the request", code="generation_failed")
            return item
    raise AssertionError("a stream ends with its GenerateOutput")


async def merged(streams: Sequence[EventStream]) -> AsyncIterator[tuple[int, StreamChunk | GenerateOutput]]:
    """(choice index, item) from every choice's stream as they come; each stream's items in
    order. One stream is read directly (no task, no queue: the common case costs nothing).

    The queue holds one item a stream: a reader that stops reading stops the pumps, and each
    choice's backlog then builds in its own stream, which pauses its request (backpressure,
    gateway/service/stream.py); an unbounded queue here took every token of every choice."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))
    done = object()

    async def pump(i: int, stream: EventStream) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except Exception as exc:                   # raised where the events are read
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.aclose()
