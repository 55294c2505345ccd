"""The Responses API's operations, over the generation service and two stores.

    create     a request through the same checks, limits, scheduler and speculation as chat
               completions (`GenerationService.open_stream`, or `open_detached` for a background
               response, which runs whether or not anyone is connected);
    retrieve   a response's object, or its events (`ResponseReader.follow`): what its request has
               committed, then what it commits until it ends;
    cancel, delete   tenant-scoped: another tenant's response is a 404, as a missing one;
    finalize, forget_tenant, sweep_tenants   keeping an ended response's output, and dropping a
               removed tenant's.

The service is the front door; the work is in two rooms beside it: reading a response back (its
object and its events, gateway/responses/reader.py) and keeping it (quota, its output, removal,
gateway/responses/keeper.py).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable, Iterable

from gateway import errors
from gateway.errors import ApiError
from gateway.replay import FALLBACK_S
from gateway.responses.keeper import ResponseKeeper
from gateway.responses.objects import Header, deleted, response
from gateway.responses.quota import Quota
from gateway.responses.reader import ResponseReader
from gateway.responses.request import ResponseRequest
from gateway.responses.store import ResponseStore
from gateway.schemas import SpeculationOptions
from gateway.service import GenerateInput, GenerateOutput
from gateway.tenancy.records import Tenant
from scheduler.store import StateStore

log = logging.getLogger(__name__)

# the generation service's names for fields this API names otherwise
_PARAMS = {"max_tokens": "max_output_tokens", "messages": "input"}
CANCEL_WAIT_S = 5.0    # how long a cancel waits to return the cancelled response


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


class ResponseService:
    def __init__(self, generation: Any, responses: ResponseStore, records: StateStore,
                 tokenizer: Any, *, fallback_s: float = FALLBACK_S,
                 cancel: Callable[[str], Any] | None = None, quota: Quota | None = None) -> None:
        """`generation`: `GenerationService` (or Ray mode's remote one); `records`: the
        scheduler's state store, read only; `cancel(request_id)`: ends a request (default: the
        generation service's `cancel`; may be a coroutine function); `quota`: what a tenant may
        keep, where its record does not say (default: the store's TTL, no caps)."""
        self.generation = generation
        self.reader = ResponseReader(responses, records, tokenizer, fallback_s=fallback_s)
        self.keeper = ResponseKeeper(responses, records, tokenizer, quota)
        self._cancel = cancel if cancel is not None else generation.cancel
        self._held: set[asyncio.Task] = set()

    # The stores both rooms use, one each: set here, both see it (a store swapped on one room
    # alone would leave the other reading or writing the old one). The tokenizer and the quota
    # are fixed at construction.
    @property
    def responses(self) -> ResponseStore:
        return self.reader.responses

    @responses.setter
    def responses(self, store: ResponseStore) -> None:
        self.reader.responses = self.keeper.responses = store

    @property
    def records(self) -> StateStore:
        return self.reader.records

    @records.setter
    def records(self, store: StateStore) -> None:
        self.reader.records = self.keeper.records = store

    @property
    def fallback_s(self) -> float:
        """How long a follower waits for a commit's notification before it reads anyway."""
        return self.reader.fallback_s

    @fallback_s.setter
    def fallback_s(self, value: float) -> None:
        self.reader.fallback_s = value

    # ---- create ----------------------------------------------------------------------------------
    async def create(self, tenant: Tenant, body: ResponseRequest) -> dict | AsyncIterator[dict]:
        """The response object, or (`stream`) its events as they come."""
        store = body.store is not False
        if body.background and not store:
            raise errors.invalid("a background response must be stored: send store: true", "store")
        messages = body.messages
        if body.previous_response_id is not None:
            messages = await self.reader.conversation(tenant, body.previous_response_id) + messages
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
            await self.keeper.keep(tenant, header)      # before any work is done for it
        try:
            if header.background:
                await self.generation.open_detached(inp)
                stream = None
            else:
                stream = await self.generation.open_stream(inp)
        except BaseException as e:
            if store:
                await self.keeper.drop(rid)
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
        return await self.reader.object(header)

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
            async for ev in self.reader.follow(header, after):
                yield ev
        finally:
            if waiter is not None and not waiter.done():
                waiter.cancel()                         # closes the stream: cancels the request

    # ---- read ------------------------------------------------------------------------------------
    async def retrieve(self, tenant: Tenant, response_id: str, *, stream: bool = False,
                       starting_after: int | None = None) -> dict | AsyncIterator[dict]:
        held = await self.reader.stored(tenant, response_id)
        if stream:
            after = -1 if starting_after is None else starting_after
            return self.reader.follow(held.header, after)
        return await self.reader.object(held.header, held)

    # ---- end -------------------------------------------------------------------------------------
    async def cancel(self, tenant: Tenant, response_id: str) -> dict:
        held = await self.reader.stored(tenant, response_id)
        if not held.header.background:
            raise errors.invalid("only a background response can be cancelled", "response_id")
        outcome = await self.reader.outcome(held)
        if outcome is not None and not outcome.terminal:
            await self._end(response_id)
            await self.reader.until_ended(response_id, time.monotonic() + CANCEL_WAIT_S)
            outcome = await self.reader.outcome(held)
        return response(held.header, outcome)

    async def delete(self, tenant: Tenant, response_id: str) -> dict:
        held = await self.reader.stored(tenant, response_id)
        outcome = await self.reader.outcome(held)
        if outcome is not None and not outcome.terminal:
            await self._end(response_id)                # nobody could read it any more
        await self.keeper.drop(response_id)
        return deleted(response_id)

    async def _end(self, response_id: str) -> None:
        done = self._cancel(response_id)
        if asyncio.iscoroutine(done):
            await done

    # ---- kept ------------------------------------------------------------------------------------
    def finalize(self, response_id: str) -> bool:
        """`ResponseKeeper.finalize`: an ended response's output kept (any thread; blocking)."""
        return self.keeper.finalize(response_id)

    async def forget_tenant(self, tenant_id: str) -> int:
        """`ResponseKeeper.forget_tenant`: a removed tenant's stored responses go."""
        return await self.keeper.forget_tenant(tenant_id)

    def sweep_tenants(self, list_tenants: Callable[[], Iterable[Tenant]]) -> list[str]:
        """`ResponseKeeper.sweep_tenants` (any thread; blocking)."""
        return self.keeper.sweep_tenants(list_tenants)


def _generate_input(tenant: Tenant, body: ResponseRequest, header: Header) -> GenerateInput:
    spec = body.speculation or SpeculationOptions()
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    return GenerateInput(tenant=tenant, model=body.model, messages=system + header.messages,
                         max_tokens=body.max_output_tokens, temperature=header.temperature,
                         top_p=header.top_p, seed=body.seed, speculation=spec.enabled,
                         max_tree_tokens=spec.max_tree_tokens, user=body.user,
                         request_id=header.id, detached=header.background,
                         service_tier=header.service_tier)
