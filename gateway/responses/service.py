"""The Responses API's operations, over the generation service and two stores.

    create     a request through the same checks, limits, scheduler and speculation as chat
               completions (`GenerationService.open_stream`, or `open_detached` for a background
               response, which runs whether or not anyone is connected);
    follow     a response's events (gateway/responses/events.py) read from the scheduler's state
               store: what it has committed, then what it commits until it ends. Every stream a
               client gets is one of these, so a live stream and a resumed one are the same
               events with the same numbers;
    retrieve, cancel, delete   tenant-scoped: another tenant's response is a 404, as a missing one;
    forget_tenant, sweep_tenants   a removed tenant's stored responses go with it.

Where things are read: a response's owner, what it asked and, once it has ended, its output (its
tokens and their text, decoded once when it ends), in the response store
(gateway/responses/store.py); its tokens while it runs, in the scheduler's state store
(`StateStore.tail`), which a step writes before it streams anything. A follower reads and decodes
only the tokens it has not seen; a read of many (a GET of a running response, a resumed stream's
catch-up) is decoded on a worker thread, never on the event loop. It reads when a step has
committed (`StateStore.watch`: a wait that holds no thread), or `fallback_s` after its last read
(gateway/replay.py says why).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable, Iterable

from gateway import errors
from gateway.errors import ApiError
from gateway.responses.events import EventLog, text_of
from gateway.responses.objects import Header, Outcome, deleted, response
from gateway.responses.quota import Quota, quota_of, refusal
from gateway.responses.request import ResponseRequest
from gateway.replay import FALLBACK_S, INLINE_TOKENS
from gateway.responses.store import ResponseStore, Stored
from gateway.schemas import SpeculationOptions
from gateway.service import GenerateInput, GenerateOutput
from gateway.tenancy.records import Tenant
from scheduler.request import RequestStats, Status, finish_reason
from scheduler.store import Tail
from scheduler.store.base import RecordReader

log = logging.getLogger(__name__)

# the generation service's names for fields this API names otherwise
_PARAMS = {"max_tokens": "max_output_tokens", "messages": "input"}
CANCEL_WAIT_S = 5.0    # how long a cancel waits to return the cancelled response
ADMIT_WAIT_S = 30.0    # how long a follower of a created response waits for its request's record


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", param="response_id",
                    code="response_not_found", type="invalid_request_error")


def final_of(tail: Tail, tokenizer: Any) -> dict[str, Any]:
    """What the response store keeps of an ended response (`ResponseStore.finalize`): its text
    too, so that reading it back decodes nothing."""
    s = tail.stats
    prompt = tail.prompt_ids or []
    return {"status": s.status.value, "reason": _reason(tail), "output_ids": tail.tokens,
            "text": text_of(tokenizer, prompt, tail.tokens),
            "context": prompt[-8:], "input_tokens": s.prompt_len, "ended_at": s.finished_s}


def _reason(tail: Tail) -> str | None:
    return finish_reason(tail.stats.status, tail.stats.cause)


class ResponseService:
    def __init__(self, generation: Any, responses: ResponseStore, records: RecordReader,
                 tokenizer: Any, *, fallback_s: float = FALLBACK_S,
                 cancel: Callable[[str], Any] | None = None, quota: Quota | None = None) -> None:
        """`generation`: `GenerationService` (or Ray mode's remote one); `records`: the
        scheduler's state store, read only; `cancel(request_id)`: ends a request (default: the
        generation service's `cancel`; may be a coroutine function); `quota`: what a tenant may
        keep, where its record does not say (default: the store's TTL, no caps)."""
        self.generation = generation
        self.responses = responses
        self.quota = quota
        self.records = records
        self.tokenizer = tokenizer
        self.fallback_s = fallback_s
        self._cancel = cancel if cancel is not None else generation.cancel
        self._held: set[asyncio.Task] = set()

    # ---- blocking store calls, off the event loop ---------------------------------------------------
    async def _io(self, remote: bool, fn: Callable, *args: Any, **kw: Any) -> Any:
        return await errors.store_call(remote, fn, *args, **kw)

    async def _kept(self, fn: Callable, *args: Any) -> Any:
        """A response store's call: on a worker thread, in memory too (its calls measure or copy
        a response, work that grows with it)."""
        return await errors.store_call(True, fn, *args)

    async def _stored(self, tenant: Tenant, response_id: str) -> Stored:
        held = await self._kept(self.responses.get, response_id)
        if held is None or held.header.tenant_id != tenant.id:
            raise not_found(response_id)                # another tenant's: as if it did not exist
        return held

    async def _tail(self, response_id: str, start: int, prompt: bool = False) -> Tail | None:
        return await self._io(self.records.remote, self.records.tail, response_id, start,
                              prompt=prompt)

    # ---- create ----------------------------------------------------------------------------------
    async def create(self, tenant: Tenant, body: ResponseRequest) -> dict | AsyncIterator[dict]:
        """The response object, or (`stream`) its events as they come."""
        store = body.store is not False
        if body.background and not store:
            raise errors.invalid("a background response must be stored: send store: true", "store")
        messages = body.messages
        if body.previous_response_id is not None:
            messages = await self._conversation(tenant, body.previous_response_id) + messages
        rid = new_response_id()
        header = Header(rid, tenant.id, body.model, int(time.time()), messages, body.instructions,
                        background=bool(body.background), store=store,
                        previous_response_id=body.previous_response_id,
                        max_output_tokens=body.max_output_tokens,
                        temperature=1.0 if body.temperature is None else body.temperature,
                        top_p=1.0 if body.top_p is None else body.top_p,
                        metadata=dict(body.metadata or {}),
                        service_tier=tenant.tier_for(body.service_tier))
        inp = _generate_input(tenant, body, header)
        if store:
            await self._keep(tenant, header)
        try:
            if header.background:
                await self.generation.open_detached(inp)
                stream = None
            else:
                stream = await self.generation.open_stream(inp)
        except BaseException as e:
            if store:
                await self._kept(self.responses.delete, rid)
            if isinstance(e, ApiError) and e.param in _PARAMS:
                e.param = _PARAMS[e.param]              # as this API names it
            raise
        if stream is not None:                          # tied to this client: ends with it
            waiter = asyncio.get_running_loop().create_task(self._drain(stream, store))
            self._held.add(waiter)
            waiter.add_done_callback(self._held.discard)
        else:
            waiter = None
        if body.stream:
            return self._follow_then_close(header, -1, waiter)
        if waiter is not None:
            try:
                await asyncio.shield(waiter)
            except asyncio.CancelledError:              # the client left: so does the request
                waiter.cancel()
                raise
        return await self._object(header)

    async def _keep(self, tenant: Tenant, header: Header) -> None:
        """Store a new response within its tenant's quota (429 or 403 past it), before any work
        is done for it."""
        quota = quota_of(tenant, self.quota) if self.quota is not None else None
        kept = await self._kept(self.responses.put, header, quota)
        if kept:
            return
        if kept.over is not None and quota is not None:
            raise refusal(kept, quota)
        raise ApiError(500, "response id collision; retry the request", code="server_error")

    async def _drain(self, stream: Any, store: bool) -> GenerateOutput | None:
        """Run a client-tied request to its end (cancelled: the request is cancelled), then keep
        its output if it is stored."""
        out = None
        try:
            async for item in stream:
                if isinstance(item, GenerateOutput):
                    out = item
        finally:
            await stream.aclose()
            if store:
                try:
                    await asyncio.shield(asyncio.to_thread(self.finalize, stream.request_id))
                except Exception:
                    log.exception("keeping response %s failed", stream.request_id)
        return out

    async def _follow_then_close(self, header: Header, after: int,
                                 waiter: asyncio.Task | None) -> AsyncIterator[dict]:
        try:
            async for ev in self._follow(header, after):
                yield ev
        finally:
            if waiter is not None and not waiter.done():
                waiter.cancel()                         # closes the stream: cancels the request

    async def _conversation(self, tenant: Tenant, previous_id: str) -> list[dict]:
        """The messages of a stored response, its output included, to continue from."""
        held = await self._stored(tenant, previous_id)
        outcome = await self._outcome(held)
        if outcome is None or not outcome.terminal:
            raise errors.invalid(f"previous response '{previous_id}' has not finished",
                                 "previous_response_id")
        if outcome.status is not Status.FINISHED:
            raise errors.invalid(f"previous response '{previous_id}' did not complete "
                                 f"({outcome.status.value})", "previous_response_id")
        return [*held.header.messages, {"role": "assistant", "content": outcome.text}]

    # ---- read ------------------------------------------------------------------------------------
    async def retrieve(self, tenant: Tenant, response_id: str, *, stream: bool = False,
                       starting_after: int | None = None) -> dict | AsyncIterator[dict]:
        held = await self._stored(tenant, response_id)
        if stream:
            after = -1 if starting_after is None else starting_after
            return self._follow(held.header, after)
        return await self._object(held.header, held)

    async def _object(self, header: Header, held: Stored | None = None) -> dict:
        if held is None:
            held = await self._kept(self.responses.get, header.id)
            held = held or Stored(header, None)
        return response(header, await self._outcome(held))

    async def _outcome(self, held: Stored) -> Outcome | None:
        """What the response's request has produced: its kept final, else its record now."""
        final = held.final
        if final is not None:
            ids = final.get("output_ids") or []
            text = final.get("text")
            if not isinstance(text, str):               # kept before finals held their text
                text = await self._text_of(final.get("context") or [], ids)
            return Outcome(Status(final["status"]), final.get("reason"), text,
                           int(final.get("input_tokens") or 0), len(ids), final.get("ended_at"))
        tail = await self._tail(held.header.id, 0, prompt=True)
        if tail is None:
            return None                                 # not admitted yet
        s = tail.stats
        return Outcome(s.status, _reason(tail), await self._text_of(tail.prompt_ids or [], tail.tokens),
                       s.prompt_len, len(tail.tokens), s.finished_s)

    async def _text_of(self, prompt_ids: list[int], tokens: list[int]) -> str:
        """`text_of`, on a worker thread when there are many tokens."""
        if len(tokens) > INLINE_TOKENS:
            return await asyncio.to_thread(text_of, self.tokenizer, prompt_ids, tokens)
        return text_of(self.tokenizer, prompt_ids, tokens)

    @staticmethod
    async def _pushed(log_: EventLog, tokens: list[int]) -> list[dict]:
        """`log_.push`, on a worker thread when there are many tokens (a resumed stream's
        catch-up); a follower's later reads are a step's tokens each."""
        if len(tokens) > INLINE_TOKENS:
            return await asyncio.to_thread(log_.push, tokens)
        return log_.push(tokens)

    async def _follow(self, header: Header, after: int) -> AsyncIterator[dict]:
        """Every event of the response numbered above `after`: those its committed tokens give,
        then new ones as steps commit them, until it ends. Nothing here asks for generation: a
        resumed stream is read from the stores."""
        log_: EventLog | None = None
        start, admit_by = 0, time.monotonic() + ADMIT_WAIT_S
        try:
            async with self.records.watch(header.id) as watch:
                while True:
                    tail = await self._tail(header.id, start, prompt=log_ is None)
                    if tail is None:
                        held = await self._kept(self.responses.get, header.id)
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
                    for ev in await self._pushed(log_, tail.tokens):
                        if ev["sequence_number"] > after:
                            yield ev
                    s = tail.stats
                    if s.status.terminal:
                        outcome = Outcome(s.status, _reason(tail), "", s.prompt_len, start,
                                          s.finished_s)
                        for ev in log_.finish(outcome):
                            if ev["sequence_number"] > after:
                                yield ev
                        return
                    await watch.wait(self.fallback_s)
        except errors.STORE_ERRORS:      # the notifications, lost with Redis: the client's 503
            raise errors.store_unavailable() from None

    # ---- end -------------------------------------------------------------------------------------
    def finalize(self, response_id: str) -> bool:
        """Keep an ended response's output in the response store (any thread; blocking). Called
        when its request ends (`GenerationService.detached_ended`, a client-tied stream's end)."""
        tail = self.records.tail(response_id, 0, prompt=True)
        if tail is None or not tail.stats.status.terminal:
            return False
        return self.responses.finalize(response_id, final_of(tail, self.tokenizer))

    async def cancel(self, tenant: Tenant, response_id: str) -> dict:
        held = await self._stored(tenant, response_id)
        if not held.header.background:
            raise errors.invalid("only a background response can be cancelled", "response_id")
        outcome = await self._outcome(held)
        if outcome is not None and not outcome.terminal:
            done = self._cancel(response_id)
            if asyncio.iscoroutine(done):
                await done
            await self._until_ended(response_id, time.monotonic() + CANCEL_WAIT_S)
            outcome = await self._outcome(held)
        return response(held.header, outcome)

    async def _until_ended(self, response_id: str, deadline: float) -> None:
        """Wait for a response's request to end (or `deadline`), reading its status and only the
        tokens not yet read, as steps commit them: its text is decoded once, when it has ended."""
        seen = 0
        try:
            async with self.records.watch(response_id) as watch:
                while (left := deadline - time.monotonic()) > 0:
                    tail = await self._tail(response_id, seen)
                    if tail is None or tail.stats.status.terminal:
                        return
                    seen += len(tail.tokens)
                    await watch.wait(min(left, self.fallback_s))
        except errors.STORE_ERRORS:
            raise errors.store_unavailable() from None

    async def delete(self, tenant: Tenant, response_id: str) -> dict:
        held = await self._stored(tenant, response_id)
        outcome = await self._outcome(held)
        if outcome is not None and not outcome.terminal:
            done = self._cancel(response_id)            # nobody could read it any more
            if asyncio.iscoroutine(done):
                await done
        await self._kept(self.responses.delete, response_id)
        return deleted(response_id)

    # ---- tenants removed ---------------------------------------------------------------------------
    async def forget_tenant(self, tenant_id: str) -> int:
        """A tenant was removed (the admin API's DELETE): its stored responses go too (none of
        them could be read again: ids of tenants are never reused). Returns how many."""
        return await self._kept(self.responses.drop_tenant, tenant_id)

    def sweep_tenants(self, list_tenants: Callable[[], Iterable[Tenant]]) -> list[str]:
        """Drop the stored responses of every tenant that `list_tenants()` (the tenants now) no
        longer holds: one whose removal's own drop failed (the store away), or a response put
        by a request of it that was already under way. Any thread (blocking). Returns the ids.

        NOTE: the store's tenants are read *before* the tenants: a tenant created between the
        two reads is then in the second, never taken for removed."""
        held = self.responses.tenants()
        live = {t.id for t in list_tenants()}
        gone = sorted(held - live)
        for tenant_id in gone:
            self.responses.drop_tenant(tenant_id)
        return gone


def _generate_input(tenant: Tenant, body: ResponseRequest, header: Header) -> GenerateInput:
    spec = body.speculation or SpeculationOptions()
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    return GenerateInput(tenant=tenant, model=body.model, messages=system + header.messages,
                         max_tokens=body.max_output_tokens, temperature=header.temperature,
                         top_p=header.top_p, seed=body.seed, speculation=spec.enabled,
                         max_tree_tokens=spec.max_tree_tokens, user=body.user,
                         request_id=header.id, detached=header.background,
                         service_tier=header.service_tier)


def _tail_of_final(final: dict, start: int) -> Tail:
    ids = final.get("output_ids") or []
    stats = RequestStats(final.get("id", ""), "", 0.0, prompt_len=int(final.get("input_tokens") or 0),
                         max_tokens=max(1, len(ids)), status=Status(final["status"]),
                         committed=len(ids))
    stats.finished_s = final.get("ended_at")
    reason = final.get("reason")
    stats.cause = {"stop": "stop", "length": "length"}.get(reason or "", None)
    return Tail(list(ids[start:]), stats, {}, list(final.get("context") or []))
