"""Refusing a generation request whose key is known to be over its limit, before any work on it.

`install(app, book)` puts two things on the app:

    the gate     an ASGI middleware, outermost: a POST to a generation route (the routes that
                 charge an arrival, `GENERATION_PATHS`) whose bearer key's digest has a verdict
                 in the `RefusalBook` (gateway/http/refusal_book.py) is answered there with the
                 limiter's 429 (the same code, words and Retry-After the full path gives), with
                 no routing, no dependency, no thread hop, no store call and no body parsed,
                 after a hold (`hold_s`, at most the Retry-After): a refusal that cost nothing
                 would otherwise only let a client that retries at once send more of them;
    the note     the app's `ApiError` handler, wrapped: a 429 the full path gave for `rpm` or
                 `concurrency` to a request that passed the gate is noted in the book under its
                 key's digest, for its tenant (which `remember_tenant` left in the request's
                 scope once the key was authenticated).

A request without a verdict passes the gate having cost one SHA-256 of its key, which every
key costs alike. Only generation routes are gated: a tenant over its limits may still list its
models or read its stored responses, as on the full path.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from gateway.errors import ApiError
from gateway.http.refusal_book import KINDS, RefusalBook
from gateway.metrics import GatewayMetrics
from gateway.service.admission import limit_refusal
from gateway.tenancy.records import Tenant, presented_digest

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
_DIGEST = "specgate.key_digest"        # in the ASGI scope: set by the gate, read by the note
_TENANT = "specgate.tenant"            # set by `remember_tenant`, read by the note
_CODES = {f"{kind}_exceeded": kind for kind in KINDS}


def install(app: FastAPI, book: RefusalBook, metrics: GatewayMetrics, *,
            hold_s: float = 0.0) -> None:
    """Gate the app's generation routes with `book` (module docstring). Call after every other
    middleware and exception handler is added: the gate must be outermost, and the note wraps
    the `ApiError` handler installed before it."""
    answer = app.exception_handlers[ApiError]

    async def note(request: Request, exc: Exception) -> Response:
        if isinstance(exc, ApiError) and exc.status == 429 and exc.code in _CODES:
            digest, tenant = request.scope.get(_DIGEST), request.scope.get(_TENANT)
            if digest is not None and tenant is not None:
                book.note(digest, tenant, _CODES[exc.code], exc.retry_after_s or 0.0)
        return await answer(request, exc)

    app.add_exception_handler(ApiError, note)
    app.add_middleware(Gate, book=book, metrics=metrics, hold_s=hold_s)


def remember_tenant(request: Request, tenant: Tenant) -> None:
    """The authenticated tenant of a generation request, for a refusal of it to be noted."""
    request.scope[_TENANT] = tenant


def bearer_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The bearer key of raw ASGI headers, read as `gateway.http.deps.bearer_key` reads it."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, key = value.decode("latin-1").strip().partition(" ")
            return key.strip() or None if scheme.lower() == "bearer" else None
    return None


class Gate:
    """The ASGI middleware (module docstring)."""

    def __init__(self, app: Any, book: RefusalBook, metrics: GatewayMetrics,
                 hold_s: float = 0.0) -> None:
        """`hold_s`: how long a refusal is held before it is answered (at most its own
        Retry-After): a closed-loop client then gets one refusal per connection per hold, so a
        cheaper refusal does not just let it send more of them."""
        self.app, self.book, self.metrics, self.hold_s = app, book, metrics, hold_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or scope["method"] != "POST"
                or scope["path"] not in GENERATION_PATHS):
            return await self.app(scope, receive, send)
        key = bearer_key(scope.get("headers") or [])
        if key is None:
            return await self.app(scope, receive, send)
        digest = presented_digest(key)
        found = self.book.refusal(digest)
        if found is None:
            scope[_DIGEST] = digest
            return await self.app(scope, receive, send)
        tenant, exc = found
        self.metrics.refused(tenant, str(exc.kind), "rate_limited")     # as Admission counts
        hold = min(self.hold_s, exc.retry_after_s)
        if hold > 0:
            await asyncio.sleep(hold)              # a timer: nothing of the loop's is held
        await _send(send, limit_refusal(exc))


async def _send(send: Any, err: ApiError) -> None:
    """`err` as its JSON response, written straight to the server: the headers `ApiError.
    response()` gives (Retry-After), without building a Starlette response."""
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()),
               *((k.lower().encode(), v.encode()) for k, v in err.headers().items())]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
