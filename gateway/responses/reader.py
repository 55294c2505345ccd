"""Reading a response back: its object, its events, and waiting for its end.

Where things are read: a response's owner, what it asked and, once it has ended, its output (its
tokens and their text, decoded once when it ends), in the response store
(gateway/responses/store.py); its tokens while it runs, in the scheduler's state store
(`StateStore.tail`), which a step writes before it streams anything. A follower reads and decodes
only the tokens it has not seen; a read of many (a GET of a running response, a resumed stream's
catch-up) is decoded on a worker thread, never on the event loop. It reads when a step has
committed (`StateStore.watch`: a wait that holds no thread), or `fallback_s` after its last read
(gateway/replay.py says why).

Every stream a client gets is `ResponseReader.follow`, so a live stream and a resumed one are the
same events with the same numbers. Nothing here writes or asks for generation.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Callable

from gateway import errors
from gateway.errors import ApiError
from gateway.replay import FALLBACK_S, INLINE_TOKENS
from gateway.responses.events import EventLog, text_of
from gateway.responses.objects import Header, Outcome, response
from gateway.responses.store import ResponseStore, Stored
from gateway.tenancy.records import Tenant
from scheduler.request import RequestStats, Status, finish_reason
from scheduler.store import StateStore, Tail

ADMIT_WAIT_S = 30.0    # how long a follower of a created response waits for its request's record


def not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", param="response_id",
                    code="response_not_found", type="invalid_request_error")


def reason_of(tail: Tail) -> str | None:
    return finish_reason(tail.stats.status, tail.stats.cause)


async def kept(fn: Callable, *args: Any) -> Any:
    """A response store's call: on a worker thread, in memory too (its calls measure or copy a
    response, work that grows with it)."""
    return await errors.store_call(True, fn, *args)


class ResponseReader:
    """A tenant's responses as objects and events, read from the response store and the
    scheduler's state store (read only)."""

    def __init__(self, responses: ResponseStore, records: StateStore, tokenizer: Any, *,
                 fallback_s: float = FALLBACK_S) -> None:
        self.responses = responses
        self.records = records
        self.tokenizer = tokenizer
        self.fallback_s = fallback_s

    async def stored(self, tenant: Tenant, response_id: str) -> Stored:
        held = await kept(self.responses.get, response_id)
        if held is None or held.header.tenant_id != tenant.id:
            raise not_found(response_id)                # another tenant's: as if it did not exist
        return held

    async def tail(self, response_id: str, start: int, prompt: bool = False) -> Tail | None:
        return await errors.store_call(self.records.remote, self.records.tail, response_id, start,
                                       prompt=prompt)

    async def object(self, header: Header, held: Stored | None = None) -> dict:
        if held is None:
            held = await kept(self.responses.get, header.id)
            held = held or Stored(header, None)
        return response(header, await self.outcome(held))

    async def outcome(self, held: Stored) -> Outcome | None:
        """What the response's request has produced: its kept final, else its record now."""
        final = held.final
        if final is not None:
            ids = final.get("output_ids") or []
            text = final.get("text")
            if not isinstance(text, str):               # kept before finals held their text
                text = await self._text_of(final.get("context") or [], ids)
            return Outcome(Status(final["status"]), final.get("reason"), text,
                           int(final.get("input_tokens") or 0), len(ids), final.get("ended_at"))
        tail = await self.tail(held.header.id, 0, prompt=True)
        if tail is None:
            return None                                 # not admitted yet
        s = tail.stats
        return Outcome(s.status, reason_of(tail), await self._text_of(tail.prompt_ids or [], tail.tokens),
                       s.prompt_len, len(tail.tokens), s.finished_s)

    async def conversation(self, tenant: Tenant, previous_id: str) -> list[dict]:
        """The messages of a stored response, its output included, to continue from."""
        held = await self.stored(tenant, previous_id)
        outcome = await self.outcome(held)
        if outcome is None or not outcome.terminal:
            raise errors.invalid(f"previous response '{previous_id}' has not finished",
                                 "previous_response_id")
        if outcome.status is not Status.FINISHED:
            raise errors.invalid(f"previous response '{previous_id}' did not complete "
                                 f"({outcome.status.value})", "previous_response_id")
        return [*held.header.messages, {"role": "assistant", "content": outcome.text}]

    async def _text_of(self, prompt_ids: list[int], tokens: list[int]) -> str:
        """`text_of`, on a worker thread when there are many tokens."""
        if len(tokens) > INLINE_TOKENS:
            return await asyncio.to_thread(text_of, self.tokenizer, prompt_ids, tokens)
        return text_of(self.tokenizer, prompt_ids, tokens)

    async def follow(self, header: Header, after: int) -> AsyncIterator[dict]:
        """Every event of the response numbered above `after`: those its committed tokens give,
        then new ones as steps commit them, until it ends. Nothing here asks for generation: a
        resumed stream is read from the stores."""
        log_: EventLog | None = None
        start, admit_by = 0, time.monotonic() + ADMIT_WAIT_S
        try:
            async with self.records.watch(header.id) as watch:
                while True:
                    tail = await self.tail(header.id, start, prompt=log_ is None)
                    if tail is None:
                        held = await kept(self.responses.get, header.id)
                        if held is not None and held.final is not None:   # expired: kept here
                            tail = _tail_of_final(held.final, start if log_ is not None else 0)
                        elif log_ is None and time.monotonic() < admit_by:  # not admitted yet
                            await watch.wait(min(self.fallback_s, admit_by - time.monotonic()))
                            continue
                        else:
                            raise not_found(header.id)
                    if log_ is None:
                        log_ = EventLog(header, self.tokenizer, tail.prompt_ids or [])
                        for ev in log_.start():
                            if ev["sequence_number"] > after:
                                yield ev
                    start += len(tail.tokens)
                    for ev in await _pushed(log_, tail.tokens):
                        if ev["sequence_number"] > after:
                            yield ev
                    s = tail.stats
                    if s.status.terminal:
                        outcome = Outcome(s.status, reason_of(tail), "", s.prompt_len, start,
                                          s.finished_s)
                        for ev in log_.finish(outcome):
                            if ev["sequence_number"] > after:
                                yield ev
                        return
                    await watch.wait(self.fallback_s)
        except errors.STORE_ERRORS:      # the notifications, lost with Redis: the client's 503
            raise errors.store_unavailable() from None

    async def until_ended(self, response_id: str, deadline: float) -> None:
        """Wait for a response's request to end (or `deadline`), reading its status and only the
        tokens not yet read, as steps commit them: its text is decoded once, when it has ended."""
        seen = 0
        try:
            async with self.records.watch(response_id) as watch:
                while (left := deadline - time.monotonic()) > 0:
                    tail = await self.tail(response_id, seen)
                    if tail is None or tail.stats.status.terminal:
                        return
                    seen += len(tail.tokens)
                    await watch.wait(min(left, self.fallback_s))
        except errors.STORE_ERRORS:
            raise errors.store_unavailable() from None


async def _pushed(log_: EventLog, tokens: list[int]) -> list[dict]:
    """`log_.push`, on a worker thread when there are many tokens (a resumed stream's catch-up);
    a follower's later reads are a step's tokens each."""
    if len(tokens) > INLINE_TOKENS:
        return await asyncio.to_thread(log_.push, tokens)
    return log_.push(tokens)


def _tail_of_final(final: dict, start: int) -> Tail:
    """A kept final read as a record's tail: a response whose record has expired follows from
    what the response store kept of it."""
    ids = final.get("output_ids") or []
    stats = RequestStats(final.get("id", ""), "", 0.0, prompt_len=int(final.get("input_tokens") or 0),
                         max_tokens=max(1, len(ids)), status=Status(final["status"]),
                         committed=len(ids))
    stats.finished_s = final.get("ended_at")
    reason = final.get("reason")
    stats.cause = {"stop": "stop", "length": "length"}.get(reason or "", None)
    return Tail(list(ids[start:]), stats, {}, list(final.get("context") or []))
