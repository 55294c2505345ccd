"""A stream rebuilt from the state store: what a client that lost its connection was sent, and
the rest, read from a request's record instead of from the step loop.

Why it is exact: the step loop writes a step's tokens to the state store before it streams them
(scheduler/loop.py), so every token a client was ever sent is in the record; and the text a client
is shown after k tokens is a function of those k tokens alone (gateway/text.py `OutputText`,
which the live stream uses too). So a replay shows the same text at every token as the live
stream did, however steps grouped the tokens, and cuts at the same stop string.

    Replayer.open(tenant, id)   the record, tenant-scoped: another tenant's id is a 404, as an
                                unknown (or expired) one is
    Replayer.stream(record, …)  its events after a cursor, as the live stream's types
                                (`StreamChunk`s, then one `GenerateOutput`): committed ones at
                                once, then new ones as steps commit them, until it ends

Cursors: `chars`, the content characters the client has (a chat stream's SSE ids), or `tokens`,
the output tokens it has (gRPC's `Resume.after`: the token ids of the deltas it received; the
text a live delta ends on is that of its last token, so both cursors are exact). A follower asks
for no generation: a resumed stream costs no verification work.

A follower of a running request reads the store when a step has committed its tokens, not on a
clock: it waits on the store's notification (`StateStore.watch`, scheduler/store/watch.py),
which holds no thread. It also reads when `fallback_s` pass without one: a safety net for a writer
that does not publish (an older release's, during a rolling update), never the way it keeps up.
What a follower may hold (a slot of its tenant's, charged to its rpm) is decided before it is
opened: gateway/followers.py.
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence

from gateway import errors
from gateway.errors import ApiError
from gateway.service import GenerateOutput, SpecStats, StreamChunk
from gateway.tenancy.records import Tenant
from gateway.text import OutputText
from scheduler.request import Request, RequestStats, Status, finish_reason
from scheduler.store.base import RecordReader, Watch

FALLBACK_S = 1.0     # a follower reads this long after its last read even if nothing woke it
# a read of more tokens than this (a resume's catch-up) is decoded on a worker thread: the text
# of a whole output is work in proportion to it, which the event loop must not do
INLINE_TOKENS = 64
STOP_WAIT_S = 2.0    # after a stop string, how long to wait for the record's end (its final stats)


def not_found(request_id: str) -> ApiError:
    return ApiError(404, f"no request with id '{request_id}' (or it has expired)",
                    param="request_id", code="request_not_found")


@dataclass(frozen=True)
class Cursor:
    """Where a client is: `chars` content characters, or `tokens` output tokens (None: both
    None, from the start)."""
    chars: int | None = None
    tokens: int | None = None


class Replayer:
    def __init__(self, records: RecordReader, tokenizer: Any, *,
                 fallback_s: float = FALLBACK_S) -> None:
        """`records`: the scheduler's state store, read only."""
        self.records = records
        self.tokenizer = tokenizer
        self.fallback_s = fallback_s

    async def _io(self, fn: Callable, *args: Any, **kw: Any) -> Any:
        return await errors.store_call(self.records.remote, fn, *args, **kw)

    async def open(self, tenant: Tenant, request_id: str) -> Request:
        """The record of `tenant`'s request (ApiError 404 otherwise): prompt, stop strings,
        committed tokens, stats and meta, from one consistent read."""
        req = await self._io(self.records.get, request_id)
        if req is None or req.stats.tenant_id != tenant.id:
            raise not_found(request_id)              # another tenant's: as if it did not exist
        return req

    def stream(self, req: Request, cursor: Cursor = Cursor()) -> "ReplayStream":
        return ReplayStream(self, req, cursor)


class ReplayStream:
    """A record's events after `cursor`, as an `EventStream` (gateway/service/types.py): chunks of the
    text not yet sent (one per read of the store), then the `GenerateOutput` of the whole
    request. Closing it stops reading and touches nothing else."""

    def __init__(self, replayer: Replayer, req: Request, cursor: Cursor) -> None:
        self.replayer = replayer
        self.request_id = req.stats.request_id
        self.service_tier = req.stats.tier
        self._req = req
        self._cursor = cursor
        self._text = OutputText(replayer.tokenizer, req.prompt_ids, req.stop)
        self._ids: list[int] = []          # tokens taken (the output's)
        self._pending: list[int] = []      # taken, past the cursor, not yet in a chunk
        self._closed = False

    def __aiter__(self) -> AsyncIterator[StreamChunk | GenerateOutput]:
        return self._events()

    async def aclose(self) -> None:
        self._closed = True

    async def _events(self) -> AsyncIterator[StreamChunk | GenerateOutput]:
        try:
            async with (self.replayer.records.watch(self.request_id) as watch,
                        contextlib.aclosing(self._followed(watch)) as followed):
                stats = None
                async for item in followed:
                    if isinstance(item, RequestStats):
                        stats = item
                    else:
                        yield item
        except errors.STORE_ERRORS:     # the notifications, lost with Redis: the client's 503
            raise errors.store_unavailable() from None
        if self._closed or stats is None:
            return
        chunk = self._chunk(self._visible(self._text.finish()))
        if chunk is not None:
            yield chunk
        yield self._output(stats)

    async def _followed(self, watch: Watch) -> AsyncIterator[StreamChunk | RequestStats]:
        """The chunks of what the record holds and of what steps commit, read when `watch`
        wakes; then the record's last stats (the request ended, or a stop string cut it)."""
        r = self.replayer
        tokens, stats, read = list(self._req.output_ids), self._req.stats, len(self._req.output_ids)
        stopped_at = None
        fresh = True            # the watch began after `open` read: read once more before waiting
        while not self._closed:
            chunk = await self._take(tokens)
            if chunk is not None:
                yield chunk
            now = asyncio.get_running_loop().time()
            if self._text.stopped and stopped_at is None:
                stopped_at = now
            if stats.status.terminal or (stopped_at is not None and now - stopped_at > STOP_WAIT_S):
                yield stats
                return
            if not fresh:      # cut by a stop string: wait for its end what is left of STOP_WAIT_S
                await watch.wait(r.fallback_s if stopped_at is None
                                 else stopped_at + STOP_WAIT_S - now)
            fresh = False
            tail = await r._io(r.records.tail, self.request_id, read)
            if tail is None:
                raise not_found(self.request_id)     # expired while followed
            tokens, stats = tail.tokens, tail.stats
            read += len(tokens)

    async def _take(self, tokens: Sequence[int]) -> StreamChunk | None:
        """`_advance`, on a worker thread when the read is long (the first read of a resume).
        A follower reads only the tokens it has not seen, and each costs a bounded decode
        (gateway/text.py), so following a request costs its output once, not once a read."""
        if len(tokens) > INLINE_TOKENS:
            return await asyncio.to_thread(self._advance, tokens)
        return self._advance(tokens)

    def _advance(self, tokens: Sequence[int]) -> StreamChunk | None:
        """Push new tokens one at a time (a stop string may cut them); the chunk of text and
        tokens past the cursor, or None."""
        pieces = []
        for t in tokens:
            piece, taken = self._text.push([t])
            if not taken:
                break                                # past a stop string: never part of the output
            self._ids.append(int(t))
            c = self._cursor
            if c.tokens is not None and self._text.tokens <= c.tokens:
                continue                             # the client has this token and its text
            self._pending.append(int(t))
            pieces.append(self._visible(piece))
        return self._chunk("".join(pieces))

    def _visible(self, piece: str) -> str:
        """The part of `piece` (just added to the text shown) past a character cursor."""
        c = self._cursor.chars
        if c is None:
            return piece
        start = self._text.chars - len(piece)         # where `piece` begins in the text shown
        return piece[max(0, c - start):]

    def _chunk(self, text: str) -> StreamChunk | None:
        """A chunk when there is text to show (the live stream sends none without text; tokens
        wait for the next chunk, or the final output)."""
        if not text:
            return None
        out = StreamChunk(text, tuple(self._pending))
        self._pending.clear()
        return out

    def _output(self, s: RequestStats) -> GenerateOutput:
        """The whole request's output, as the live stream's `GenerateOutput` says it."""
        if self._text.stopped:
            reason = "stop"
        elif s.status is Status.FAILED:
            reason = "error"
        else:
            reason = finish_reason(s.status, s.cause) or "error"
        return GenerateOutput(self.request_id, self._text.text, tuple(self._ids), reason,
                              s.prompt_len, len(self._ids), SpecStats.of(s), service_tier=s.tier)
