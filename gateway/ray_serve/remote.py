"""The generation service across a process boundary (Ray mode): ingress replicas ↔ the scheduler.

`SchedulerEndpoint` runs next to the one `GenerationService` (in the scheduler replica) and turns
its results into plain tagged tuples; `RemoteService` runs in each ingress replica and offers the
routers the service's interface (`models`, `ready`, `generate`, `open_stream`) over a Ray Serve
deployment handle to that endpoint.

Wire format, one tuple per message:

    ("admitted", (request_id, tier))  first message of a stream (the tier it runs in)
    ("chunk", StreamChunk)            new text and tokens
    ("output", GenerateOutput)        last message of a stream, or a `generate` answer
    ("error", {status, message, type, param, code, retry_after_s})   a refusal (ApiError)

Why tagged tuples rather than raising: an exception crossing Ray arrives wrapped in Ray's own
error type, and `ApiError` carries a status, OpenAI fields and a Retry-After that the client must
get unchanged.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable, Sequence

import redis

from gateway import errors
from gateway.errors import ApiError, store_call, store_refusal
from gateway.service import GenerateInput, GenerateOutput, GenerationService, StreamChunk
from gateway.service.admission import limit_refusal
from gateway.tenancy.limits import LimitExceeded, Limiter
from gateway.tenancy.records import Tenant


def error_message(e: ApiError) -> tuple[str, dict]:
    return ("error", {"status": e.status, "message": e.message, "type": e.type, "param": e.param,
                      "code": e.code, "retry_after_s": e.retry_after_s})


def refusal_of(e: Exception) -> ApiError:
    """What the client gets for a failure at the scheduler: an ApiError as it is, a Redis error
    that refuses the request (down, full) as its 503; anything else is raised (a 500)."""
    if isinstance(e, ApiError):
        return e
    refusal = store_refusal(e)
    if refusal is None:
        raise e
    return refusal


def raise_error(fields: dict) -> None:
    f = dict(fields)
    raise ApiError(f.pop("status"), f.pop("message"), **f)


class SchedulerEndpoint:
    """The scheduler replica's side: the local service's calls as wire messages."""

    def __init__(self, service: GenerationService) -> None:
        self.service = service

    async def generate(self, inp: GenerateInput) -> tuple:
        try:
            return ("output", await self.service.generate(inp))
        except (ApiError, redis.RedisError) as e:
            return error_message(refusal_of(e))

    async def open_detached(self, inp: GenerateInput) -> tuple:
        """Admit a request that runs whether or not anyone listens (`GenerationService.
        open_detached`): it runs here, next to the step loop, so an ingress replica that dies
        takes nothing with it."""
        try:
            return ("admitted", await self.service.open_detached(inp))
        except (ApiError, redis.RedisError) as e:
            return error_message(refusal_of(e))

    def cancel(self, request_id: str) -> None:
        self.service.cancel(request_id)

    async def stream(self, inp: GenerateInput) -> AsyncIterator[tuple]:
        """Every message of one request. Closing this generator early (the ingress cancels the
        call when its client leaves) closes the service's stream, which cancels the request."""
        try:
            stream = await self.service.open_stream(inp)
        except (ApiError, redis.RedisError) as e:
            yield error_message(refusal_of(e))
            return
        try:
            yield ("admitted", (stream.request_id, stream.service_tier))
            async for item in stream:
                yield ("output", item) if isinstance(item, GenerateOutput) else ("chunk", item)
        finally:
            await stream.aclose()


class RemoteService:
    """The ingress replica's side: `GenerationService`'s interface over a handle to the endpoint.

    `handle` is a Ray Serve `DeploymentHandle` of the scheduler deployment (methods `generate`,
    `stream`, `ready`); `models` are the served model ids, known from the settings; `limiter`:
    the ingress's own (in Redis, shared with the scheduler's), which `arrive` charges here so a
    request over its tenant's rpm never reaches the scheduler; `store_full`: is Redis above its
    memory watermark (the ingress's own `StoreRoom.full`), never waiting."""

    def __init__(self, handle: Any, *, models: Sequence[str], started_s: int = 0,
                 limiter: Limiter | None = None,
                 store_full: Callable[[], bool] | None = None) -> None:
        self.handle = handle
        self.models = list(models)
        self.started_s = started_s
        self.limiter = limiter
        self.store_full = store_full
        self._ready = False

    async def arrive(self, tenant: Tenant) -> None:
        """`GenerationService.arrive`, against the ingress's limiter; a refusal is counted in
        the scheduler's metrics, which are the ones /metrics serves."""
        if self.store_full is not None and self.store_full():
            raise errors.store_full()
        if self.limiter is None:
            return
        try:
            await store_call(self.limiter.remote, self.limiter.arrive, tenant)
        except LimitExceeded as exc:
            self.handle.count_refusal.remote(tenant.name, exc.kind)
            raise limit_refusal(exc) from None

    def ready(self) -> bool:
        # Readiness is the scheduler's (model loaded, store reachable), asked for in `refresh`
        # so that /ready itself never blocks the ingress's event loop on a remote call.
        return self._ready

    async def refresh(self) -> None:
        try:
            self._ready = bool(await self.handle.ready.remote())
        except Exception:
            self._ready = False

    async def forget_tenant(self, tenant_id: str, name: str) -> None:
        """`GenerationService.forget_tenant`, at the scheduler replica (whose step loop and
        metrics hold what there is to forget)."""
        await self.handle.forget_tenant.remote(tenant_id, name)

    async def generate(self, inp: GenerateInput) -> GenerateOutput:
        kind, value = await self.handle.generate.remote(inp)
        if kind == "error":
            raise_error(value)
        return value

    async def open_detached(self, inp: GenerateInput) -> str:
        kind, value = await self.handle.open_detached.remote(inp)
        if kind == "error":
            raise_error(value)
        return value

    async def cancel(self, request_id: str) -> None:
        await self.handle.cancel.remote(request_id)

    async def open_stream(self, inp: GenerateInput) -> "RemoteStream":
        """Admit the request at the scheduler (raises ApiError as the local service would)."""
        gen = self.handle.options(stream=True).stream.remote(inp)
        try:
            kind, value = await gen.__anext__()
        except BaseException:
            gen.cancel()
            raise
        if kind == "error":
            raise_error(value)
        return RemoteStream(*value, gen)


class RemoteStream:
    """`RequestStream`'s interface over the endpoint's message stream."""

    def __init__(self, request_id: str, service_tier: str, gen: Any) -> None:
        self.request_id = request_id
        self.service_tier = service_tier
        self._gen = gen
        self._done = False

    def __aiter__(self) -> "RemoteStream":
        return self

    async def __anext__(self) -> StreamChunk | GenerateOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            kind, value = await self._gen.__anext__()
        except StopAsyncIteration:
            self._done = True
            raise
        if kind == "output":
            self._done = True
        elif kind == "error":                      # not sent after admission; be safe anyway
            self._done = True
            raise_error(value)
        return value

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._gen.cancel()                     # the endpoint's generator closes: request cancelled
            await asyncio.sleep(0)
