"""What routes depend on, as `Annotated` aliases, and the request plumbing the routers share.

The app's parts live on `app.state` (set once by `build_app`); routes receive them through
`ServiceDep`, `TenantsDep`, `MetricsDep`, `SettingsDep`. `TenantDep` authenticates the caller
(401 otherwise), `ArrivedTenantDep` (a generation request) also charges it to the tenant's
requests per minute, `AdminDep` requires an admin key (401 without a valid key, 403 for a tenant's
key or the metrics key), `MetricsReaderDep` an admin key or the metrics key. Bodies are read by
`json_body(Model)` or `json_value`, dependencies rather than FastAPI body parameters, so
authentication runs first and every way a body can be wrong (not UTF-8, not JSON, too deep, a
number too long, a wrong type) becomes an OpenAI error naming the field.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import (Annotated, Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Protocol,
                    Sequence, TypeVar)

from fastapi import Depends, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from gateway import errors
from gateway.errors import ApiError
from gateway.metrics import GatewayMetrics
from gateway.http.choices import merged
from gateway.http.early_refusal import remember_tenant
from gateway.http.parse import model_parser, parse_json, parsed
from gateway.keepalive import with_keepalive
from gateway.service import EventStream, GenerateOutput, GenerationService, StreamChunk
from gateway.settings import Settings
from gateway.tenancy.records import Tenant, hash_key, presented_digest
from gateway.tenancy.tenants import TenantRegistry

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


# NOTE: `async def`, though nothing here awaits: FastAPI runs a plain `def` dependency on a worker
# thread, and those hops (thread pool, capacity limiter, GIL hand-offs) took a sizeable share of
# the event loop's time per request (`specgate bench gateway`, profiled: README.md, "Serving path
# and start-up times").
async def get_service(request: Request) -> GenerationService:
    return request.app.state.service


async def get_tenants(request: Request) -> TenantRegistry:
    return request.app.state.tenants


async def get_metrics(request: Request) -> GatewayMetrics:
    return request.app.state.metrics


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


ServiceDep = Annotated[GenerationService, Depends(get_service)]
TenantsDep = Annotated[TenantRegistry, Depends(get_tenants)]
MetricsDep = Annotated[GatewayMetrics, Depends(get_metrics)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


def bearer_key(request: Request) -> str | None:
    scheme, _, key = request.headers.get("authorization", "").strip().partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


def _store_down(request: Request, tenants: TenantRegistry) -> bool:
    """Redis failed a ping or a call within the probe's cache time (never waits): a new request
    gets its 503 at once, instead of each holding a thread for a timeout (a burst during an
    outage would queue behind the thread pool for many seconds)."""
    probe = request.app.state.store_probe
    return tenants.remote and probe is not None and probe.down_now()


def _authenticate(request: Request, tenants: TenantRegistry, key: str) -> Tenant | None:
    # asked again on the thread: a request queued for a thread while the first ping failed is
    # refused at once, not after a timeout of its own
    if _store_down(request, tenants):
        raise errors.store_unavailable()
    try:
        return tenants.authenticate(key)
    except errors.STORE_ERRORS:
        probe = request.app.state.store_probe
        if probe is not None:
            probe.failed()
        raise


async def current_tenant(request: Request, tenants: TenantsDep) -> Tenant:
    key = bearer_key(request)
    if key and _store_down(request, tenants):
        raise errors.store_unavailable()
    # In Redis the lookup waits on the network (up to the store's timeout when Redis does not
    # answer): a thread's, never the event loop's. In memory it is a dict lookup: no hop.
    tenant = (await asyncio.to_thread(_authenticate, request, tenants, key)
              if key and tenants.remote else tenants.authenticate(key))
    if tenant is None:
        raise errors.unauthorized()
    return tenant


def _is_metrics_key(settings: Settings, key: str) -> bool:
    # hash_key: the setting may be the key or its "sha256:<hex>" digest, as admin keys may
    secret = settings.metrics_key
    return secret is not None and hmac.compare_digest(
        presented_digest(key), hash_key(secret.get_secret_value()))


async def require_admin(request: Request, tenants: TenantsDep, settings: SettingsDep) -> None:
    """An admin key, or 401 (none, or unknown) / 403 (a tenant's key, the metrics key). In
    Redis the lookups run in a thread, as `current_tenant`'s do."""
    key = bearer_key(request)
    if key is None:
        raise errors.unauthorized("missing admin key: send 'Authorization: Bearer <admin key>'")
    if _store_down(request, tenants):
        raise errors.store_unavailable()
    if tenants.remote:
        await asyncio.to_thread(_check_admin, tenants, settings, key)
    else:
        _check_admin(tenants, settings, key)


def _check_admin(tenants: TenantRegistry, settings: Settings, key: str) -> None:
    if tenants.is_admin(key):
        return
    if _is_metrics_key(settings, key):
        raise ApiError(403, "the metrics key reads GET /metrics only; an admin key is needed "
                            "here", code="admin_only")
    if tenants.authenticate(key) is not None:
        raise ApiError(403, "this API key is a tenant's key; an admin key is needed here",
                       code="admin_only")
    raise errors.unauthorized("invalid admin key")


async def require_metrics_reader(request: Request, tenants: TenantsDep,
                                 settings: SettingsDep) -> None:
    """An admin key or the metrics key (`metrics_key`), or 401 / 403 (a tenant's key)."""
    key = bearer_key(request)
    if key is not None and _is_metrics_key(settings, key):
        return
    await require_admin(request, tenants, settings)


TenantDep = Annotated[Tenant, Depends(current_tenant)]


async def arrived_tenant(request: Request, tenant: TenantDep, service: ServiceDep) -> Tenant:
    """The caller's tenant, its generation request charged to its requests per minute as it
    arrives (`GenerationService.arrive`): before the body is read, so a tenant over its rpm
    costs no parsing, and every refusal after this (a body that does not parse, a prompt too
    large, a template that cannot render it) has cost the tenant a request. The tenant is
    left in the request's scope first, so that a refusal for its limits can be noted
    (gateway/http/early_refusal.py) and the key's next requests refused before this runs."""
    remember_tenant(request, tenant)
    await service.arrive(tenant)
    return tenant


ArrivedTenantDep = Annotated[Tenant, Depends(arrived_tenant)]
AdminDep = Annotated[None, Depends(require_admin)]
MetricsReaderDep = Annotated[None, Depends(require_metrics_reader)]


# ---- bodies -----------------------------------------------------------------------------------------
async def json_value(request: Request) -> Any:
    """A dependency: the body as any JSON value (400 if it is not JSON), read only after the
    dependencies before it (an admin key) have passed; a large one parsed off the event loop
    (gateway/http/parse.py)."""
    return await parsed("admin", await request.body(), parse_json)


def json_body(model: type[M]) -> Callable[..., Awaitable[M]]:
    """A dependency that reads the body, after the caller is authenticated and charged to its
    requests per minute, and validates it as `model` (400 naming the field); a large body is
    parsed off the event loop, one at a time per tenant (gateway/http/parse.py)."""
    parse = model_parser(model)

    async def read(request: Request, tenant: ArrivedTenantDep) -> M:
        return await parsed(tenant.id, await request.body(), parse)

    return read


# ---- streaming and disconnects ------------------------------------------------------------------------
def sse(obj: Any, event_id: str | None = None) -> str:
    data = f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
    return data if event_id is None else f"id: {event_id}\n{data}"


class EventIds(Protocol):
    """The SSE `id:` of a stream's events, where a client may resume after them (the
    `Last-Event-ID` it sends back): gateway/http/chat_stream.py `ChatIds`."""
    def opening(self, i: int) -> str: ...

    def chunk(self, i: int, piece: StreamChunk) -> str: ...

    def final(self, i: int) -> str: ...

    def usage(self) -> str: ...


SSE_DONE = "data: [DONE]\n\n"
# an SSE comment: every client skips it; it keeps a waiting stream's connection from looking idle
SSE_KEEPALIVE = ": keep-alive\n\n"


def sse_response(events: AsyncGenerator[str, None], keepalive_s: float) -> StreamingResponse:
    """`events` as server-sent events, with a keep-alive comment each time `keepalive_s`
    seconds pass without one (`Settings.stream_keepalive_s`; gateway/keepalive.py)."""
    return StreamingResponse(with_keepalive(events, keepalive_s, SSE_KEEPALIVE),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class ClientDisconnected(Exception):
    """The client left before its (non-streaming) answer was ready; nobody reads the response."""


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (a non-streaming request whose
    client left must not keep its place in the batch): raises ClientDisconnected then. The body
    has been read already, so the next ASGI message is the disconnect."""
    task = asyncio.ensure_future(work)
    gone = asyncio.Event()

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                gone.set()
                task.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if gone.is_set() and not asyncio.current_task().cancelling():
            raise ClientDisconnected() from None
        raise
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


def _events(made: dict | list[dict]) -> list[dict]:
    return made if isinstance(made, list) else [made]


async def sse_events(streams: Sequence[EventStream], *,
                     chunk: Callable[[int, StreamChunk], dict | list[dict]],
                     final: Callable[[int, GenerateOutput], dict | list[dict]],
                     usage: Callable[[list[GenerateOutput]], dict] | None = None,
                     openings: Sequence[dict] = (),
                     ids: EventIds | None = None) -> AsyncIterator[str]:
    """A generation's choices (one stream each) as server-sent events: the `openings`, one
    `chunk(index, piece)` per piece of text (or of logprobs), each choice's `final(index,
    output)` chunk (finish_reason, specgate stats), `usage(outputs)` once every choice has
    ended, when asked for, then `data: [DONE]`. `chunk` and `final` may give a list of events
    (or none: a tool call's text is held until it is whole, gateway/tool_calls.py). Once the 200 has
    gone out an error can only be an event: a failed generation, a refusal (a follower whose
    state store went away: `store_unavailable`) or an unexpected exception ends the stream with
    an OpenAI error object. The streams are closed however this ends; a client
    that disconnects cancels every choice that way (a detached one runs on: gateway/service/stream.py).
    `ids`: each event's SSE `id:` (None: no ids)."""
    outs: dict[int, GenerateOutput] = {}
    try:
        for i, opening in enumerate(openings):
            yield sse(opening, ids and ids.opening(i))
        async for i, item in merged(streams):
            if isinstance(item, GenerateOutput):
                outs[i] = item
                for event in _events(final(i, item)):
                    yield sse(event, ids and ids.final(i))
                if item.finish_reason == "error":
                    yield sse(ApiError(500, "generation failed; retry the request",
                                       code="generation_failed").body())
            elif item.text or item.logprobs:
                event_id = ids and ids.chunk(i, item)
                for event in _events(chunk(i, item)):
                    yield sse(event, event_id)
        if usage is not None and outs:
            yield sse(usage([outs[i] for i in sorted(outs)]), ids and ids.usage())
        yield SSE_DONE
    except ApiError as exc:            # a refusal once the 200 is out (a follower's store gone)
        yield sse(exc.body())
        yield SSE_DONE
    except Exception:
        log.exception("stream %s failed", streams[0].request_id)
        yield sse(ApiError(500, "internal server error", code="internal_error").body())
        yield SSE_DONE
    finally:
        for stream in streams:
            await stream.aclose()
