"""Refusing a request whose key is known to be over its limit, before any work on it.

`EarlyRefusals` is the `RefusalBook` (gateway/http/refusal_book.py) as the fronts use it: a
request of a gated route whose bearer key's digest holds a verdict of a kind its route checks
is answered with the limiter's refusal (the same code, words and Retry-After the full path
gives), after a hold (`hold_s`, at most the Retry-After): a refusal that cost nothing would
otherwise only let a client that retries at once send more of them. A refusal of the full path
for one of the book's kinds is noted under the key's digest, for its tenant. Both fronts share
one, so a key refused on one is refused early on both (gRPC's gate: gateway/grpc_api/early.py).

The routes gated, and the kinds each asks for, are those its full path checks, in its order:

    generate   POST /v1/chat/completions, /v1/completions, /v1/responses, gRPC `Generate` and
               `GenerateStream`: the tenant's rpm, then its tpm and concurrency;
    follow     GET /v1/chat/completions/{id}/stream, GET /v1/responses/{id}?stream=true, gRPC
               `Resume` (gateway/followers.py): rpm, then the follower slots;
    read       GET /v1/responses/{id}: rpm only (one request charged, no slot).

Every other route is ungated, as it is uncharged on the full path: a tenant over its limits may
still list its models, cancel or delete its responses.

`install(app, refusals)` puts two things on the REST app:

    the gate     an ASGI middleware, outermost: no routing, no dependency, no thread hop, no
                 store call and no body read before the early refusal;
    the note     the app's `ApiError` handler, wrapped: a 429 the full path gave to a request
                 that passed the gate is noted, for the tenant `remember_tenant` left in the
                 request's scope once the key was authenticated.

A request without a verdict passes the gate having cost one SHA-256 of its key, which every
key costs alike.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import parse_qsl

from fastapi import FastAPI, Request
from fastapi.responses import Response

from gateway.errors import ApiError
from gateway.http.refusal_book import RefusalBook
from gateway.metrics import GatewayMetrics
from gateway.service.admission import limit_refusal
from gateway.tenancy.records import Tenant, presented_digest

ROUTE_KINDS = {"generate": ("rpm", "tpm", "concurrency"), "follow": ("rpm", "followers"),
               "read": ("rpm",)}
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
_CHAT, _RESPONSES = "/v1/chat/completions/", "/v1/responses/"      # a follower's id follows
_DIGEST = "specgate.key_digest"        # in the ASGI scope: set by the gate, read by the note
_ROUTE = "specgate.route"              # the same, for its route
_TENANT = "specgate.tenant"            # set by `remember_tenant`, read by the note
# the query values FastAPI reads as a bool (pydantic's), for `stream` on GET /v1/responses/{id}
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


class EarlyRefusals:
    """The book, the metrics its refusals are counted in, and the hold (module docstring)."""

    def __init__(self, book: RefusalBook, metrics: GatewayMetrics, hold_s: float = 0.0) -> None:
        """`hold_s`: how long a refusal is held before it is answered (at most its own
        Retry-After): a closed-loop client then gets one refusal per connection per hold, so a
        cheaper refusal does not just let it send more of them."""
        self.book, self.metrics, self.hold_s = book, metrics, hold_s

    def refused(self, digest: str, route: str) -> ApiError | None:
        """The refusal a request of `route` with this key digest gets now, counted as the full
        path counts it; or None (it takes the full path)."""
        found = self.book.refusal(digest, ROUTE_KINDS[route])
        if found is None:
            return None
        tenant, kind, exc = found
        self.metrics.refused(tenant, kind, "rate_limited")       # as Admission, FollowerGate count
        return limit_refusal(exc)

    async def hold(self, err: ApiError) -> None:
        """Wait out the hold before `err` is answered: a timer, nothing of the loop's is held."""
        hold = min(self.hold_s, err.retry_after_s or 0.0)
        if hold > 0:
            await asyncio.sleep(hold)

    def note(self, digest: str, tenant: Tenant, route: str, exc: BaseException) -> bool:
        """The full path refused a request of `route` with `exc`: noted if it is one of the
        book's kinds that `route` checks (a follower's `concurrency_exceeded` is its followers'
        cap). Returns whether it was noted."""
        if not isinstance(exc, ApiError) or exc.status != 429 or not exc.code:
            return False
        kind = exc.code.removesuffix("_exceeded")
        if kind == "concurrency" and route == "follow":
            kind = "followers"
        if kind not in ROUTE_KINDS[route]:
            return False
        return self.book.note(digest, tenant, kind, exc.retry_after_s or 0.0, exc.closed)


def install(app: FastAPI, refusals: EarlyRefusals) -> None:
    """Gate the app's charged routes with `refusals` (module docstring). Call after every other
    middleware and exception handler is added: the gate must be outermost, and the note wraps
    the `ApiError` handler installed before it."""
    answer = app.exception_handlers[ApiError]

    async def note(request: Request, exc: Exception) -> Response:
        digest, tenant = request.scope.get(_DIGEST), request.scope.get(_TENANT)
        if digest is not None and tenant is not None:
            refusals.note(digest, tenant, request.scope[_ROUTE], exc)
        return await answer(request, exc)

    app.add_exception_handler(ApiError, note)
    app.add_middleware(Gate, refusals=refusals)


def remember_tenant(request: Request, tenant: Tenant) -> None:
    """The authenticated tenant of a gated request, for a refusal of it to be noted."""
    request.scope[_TENANT] = tenant


def route_of(scope: dict) -> str | None:
    """The gated route an HTTP request is on (module docstring), or None. By its path as the
    router matches it (an id is one non-empty segment), and for GET /v1/responses/{id} its
    `stream` query value as FastAPI reads it: a value it would refuse leaves the request
    ungated, so it gets the full path's 422."""
    method, path = scope["method"], scope["path"]
    if method == "POST":
        return "generate" if path in GENERATION_PATHS else None
    if method != "GET":
        return None
    if path.startswith(_CHAT) and path.endswith("/stream"):
        return "follow" if _one_segment(path[len(_CHAT):-len("/stream")]) else None
    if path.startswith(_RESPONSES) and _one_segment(path[len(_RESPONSES):]):
        query = dict(parse_qsl((scope.get("query_string") or b"").decode("latin-1"),
                               keep_blank_values=True))        # as Starlette's QueryParams
        stream = query.get("stream", "false").lower()
        return "follow" if stream in _TRUE else "read" if stream in _FALSE else None
    return None


def _one_segment(s: str) -> bool:
    return bool(s) and "/" not in s


def bearer_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The bearer key of raw ASGI headers, read as `gateway.http.deps.bearer_key` reads it."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, key = value.decode("latin-1").strip().partition(" ")
            return key.strip() or None if scheme.lower() == "bearer" else None
    return None


class Gate:
    """The ASGI middleware (module docstring)."""

    def __init__(self, app: Any, refusals: EarlyRefusals) -> None:
        self.app, self.refusals = app, refusals

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        route = route_of(scope) if scope["type"] == "http" else None
        key = bearer_key(scope.get("headers") or []) if route is not None else None
        if key is None:
            return await self.app(scope, receive, send)
        digest = presented_digest(key)
        err = self.refusals.refused(digest, route)
        if err is None:
            scope[_DIGEST], scope[_ROUTE] = digest, route
            return await self.app(scope, receive, send)
        await self.refusals.hold(err)
        await _send(send, err)


async def _send(send: Any, err: ApiError) -> None:
    """`err` as its JSON response, written straight to the server: the headers `ApiError.
    response()` gives (Retry-After), without building a Starlette response."""
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()),
               *((k.lower().encode(), v.encode()) for k, v in err.headers().items())]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
