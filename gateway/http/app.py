"""The app builder: `build_app(settings, service, tenants, limiter, metrics, …)` → a FastAPI app.

The one place the HTTP front is assembled: routers, error handlers, the body-size limit. Every
part comes in as an argument and lives on `app.state` (no module-level state), so tests build as
many independent apps as they like, over the fake worker or a real model.
"""
from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from gateway import errors
from gateway.followers import FollowerGate
from gateway.http import early_refusal
from gateway.http.early_refusal import EarlyRefusals
from gateway.http.deps import ClientDisconnected
from gateway.http.refusal_book import RefusalBook
from gateway.http.routers import admin, chat, completions, health, models
from gateway.http.routers import metrics as metrics_router
from gateway.http.routers import responses as responses_router
from gateway.metrics import GatewayMetrics
from gateway.replay import Replayer
from gateway.responses.service import ResponseService
from gateway.service import GenerationService
from gateway.settings import Settings
from gateway.tenancy.limits import Limiter
from gateway.tenancy.tenants import TenantRegistry
from scheduler.store.redis_client import StoreProbe
from scheduler.store.room import StoreRoom


def build_app(settings: Settings, service: GenerationService, tenants: TenantRegistry, limiter: Limiter,
              metrics: GatewayMetrics, *, replayer: Replayer | None = None,
              responses: ResponseService | None = None,
              store_probe: StoreProbe | None = None,
              store_room: StoreRoom | None = None,
              followers: FollowerGate | None = None) -> FastAPI:
    """`replayer`: reads the state store to resume chat streams (None: resume answers 404);
    `responses`: the Responses API (None: its routes answer 404); `store_probe`: Redis's
    readiness, so new requests fail fast while it is away (None: no Redis); `store_room`:
    Redis's memory against its watermark, which /ready reports (None: no Redis); `followers`:
    what following a stream costs its tenant (default: over `limiter`,
    `max_followers_per_tenant`; share one with the gRPC front)."""
    # NOTE: /docs, /redoc and /openapi.json are off unless `openapi_docs`: they map the admin API
    # for anyone who asks. Not admin-only instead: the docs pages fetch /openapi.json with no
    # key, so behind a key they would not load. `app.openapi()` gives the schema either way.
    docs = settings.openapi_docs
    app = FastAPI(title="specgate", version="0.1.0",
                  description="OpenAI-compatible gateway with tree speculative decoding",
                  openapi_url="/openapi.json" if docs else None, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, lifespan=_lifespan(metrics))
    app.state.settings = settings
    app.state.service = service
    app.state.tenants = tenants
    app.state.limiter = limiter
    app.state.metrics = metrics
    app.state.replayer = replayer
    app.state.responses = responses
    app.state.store_probe = store_probe
    app.state.store_room = store_room
    app.state.followers = followers if followers is not None else FollowerGate(
        limiter, settings.max_followers_per_tenant, metrics=metrics)
    errors.install_handlers(app)
    app.add_exception_handler(ClientDisconnected, _client_gone)
    for r in (completions.router, chat.router, responses_router.router, models.router, health.router,
              metrics_router.router, admin.router):
        app.include_router(r)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    # the gate after (outside) the body limit: a key known to be over its limits is refused
    # before its body is read at all
    grants = getattr(service, "grants", None)
    app.state.refusal_book = book = RefusalBook(
        _slots_held(service), follower_held=_follower_slots_held(app.state.followers),
        follower_cap=app.state.followers.max_per_tenant,
        refunds=grants.refunds if grants is not None else (lambda _tenant: 0))
    # shared with the gRPC front (`early_refusals` off: None, and neither front gates)
    app.state.early_refusals = None
    if settings.early_refusals:
        app.state.early_refusals = EarlyRefusals(book, metrics, settings.early_refusal_hold_s)
        early_refusal.install(app, app.state.early_refusals)
    app.openapi = _hoisting_body_schemas(app.openapi)
    return app


def _slots_held(service: GenerationService) -> Callable[[str], int]:
    """The concurrency slots this replica holds per tenant (none where it holds no grants:
    Ray mode's ingress, whose service admits on another replica)."""
    grants = getattr(service, "grants", None)
    return grants.held if grants is not None else (lambda _tenant: 0)


def _follower_slots_held(followers: FollowerGate) -> Callable[[str], int]:
    """The follower slots this replica holds per tenant (none without a limiter: nothing is
    refused then)."""
    return followers.keeper.held if followers.keeper is not None else (lambda _tenant: 0)


def _lifespan(metrics: GatewayMetrics) -> Any:
    """While the app serves: its event loop's lag measured (gateway/looplag.py)."""
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with metrics.loop_lag.running():
            yield
    return lifespan


def _hoisting_body_schemas(openapi: Any) -> Any:
    """Bodies are read by a dependency (see gateway.http.deps), so their schemas are given as
    `openapi_extra`; move their nested models ($defs) into components, where their $refs point."""
    def schema() -> dict:
        doc = openapi()
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        for path in doc.get("paths", {}).values():
            for op in path.values():
                body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
                components.update(body.get("schema", {}).pop("$defs", {}))
        return doc
    return schema


async def _client_gone(request: Request, exc: ClientDisconnected) -> Response:
    return Response(status_code=499)       # nginx's "client closed request": nobody reads it


class BodyLimit:
    """Refuses a request body over `max_bytes` with 413 before the app reads it: by its
    Content-Length when declared, else while it arrives (chunked). The body is buffered (it is
    small by construction) and replayed; later `receive()` calls reach the server, so the app
    still hears a disconnect."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await self._refuse(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break                                  # disconnected while sending
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                return await self._refuse(send)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Any) -> None:
        err = errors.too_large(f"the request body is larger than {self.max_bytes} bytes")
        body = json.dumps(err.body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
