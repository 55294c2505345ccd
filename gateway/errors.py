"""Errors as clients see them: one exception type, one OpenAI-style JSON body, the right status.

Every refusal the gateway makes is an `ApiError`; the handlers installed by `install_handlers`
turn it, FastAPI's validation errors, Starlette's HTTP errors (404 unknown route, 405) and any
other exception into

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

with a `Retry-After` header on 429 and 503. An unexpected exception is logged with its stack and
answered with a generic 500: no stack trace, exception text or internal name reaches a client.
"""
from __future__ import annotations

import asyncio
import logging
import math
from typing import Any, Callable, Collection, Iterable, TypeVar

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from scheduler.store.redis_client import store_full as is_store_full
from scheduler.store.redis_client import write_refused

log = logging.getLogger(__name__)
T = TypeVar("T")

# OpenAI's error types by status.
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
          503: "server_error"}


class ApiError(Exception):
    """A refusal with the status, message and OpenAI fields a client gets."""

    # what the refusal says of every request of the key's tenant, not only this one (a tpm
    # refusal's `gateway.tenancy.rates.Closed`, for the refusal book: gateway/http/
    # refusal_book.py); never shown to the client
    closed: Any = None

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        h = {}
        if self.retry_after_s is not None:
            h["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        if self.status == 401:
            h["WWW-Authenticate"] = "Bearer"
        return h

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"


# ---- the common refusals, named once ---------------------------------------------------------------
def invalid(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unauthorized(message: str = "missing or invalid API key: send 'Authorization: Bearer <key>'") -> ApiError:
    return ApiError(401, message, code="invalid_api_key")


def forbidden_model(model: str) -> ApiError:
    return ApiError(403, f"this API key may not use model {model!r}", param="model",
                    code="model_not_allowed")


def forbidden_tier(tier: str, allowed: Iterable[str]) -> ApiError:
    return ApiError(403, f"this API key may not use service_tier {tier!r}; it may use "
                    f"{', '.join(repr(t) for t in allowed)} (or 'auto': its default)",
                    param="service_tier", code="service_tier_not_allowed")


def slo_unattainable(status: int, tier: str, objective_s: float, predicted_s: float,
                     retry_after_s: float) -> ApiError:
    """A request predicted to miss its tier's TTFT target (scheduler/miss.py): 429 when its own
    tenant's requests make the wait, 503 when everyone's do; Retry-After, when it would make it."""
    return ApiError(status, f"service_tier {tier!r} promises a first token within "
                    f"{objective_s:g} s; with the requests queued ahead it would take about "
                    f"{predicted_s:.1f} s; retry later", param="service_tier",
                    code="slo_unattainable", retry_after_s=max(retry_after_s, 1.0))


def unknown_model(model: str) -> ApiError:
    return ApiError(404, f"the model {model!r} does not exist", param="model",
                    code="model_not_found")


def too_large(message: str, param: str | None = None, code: str = "request_too_large") -> ApiError:
    return ApiError(413, message, param=param, code=code)


def rate_limited(message: str, retry_after_s: float | None, code: str = "rate_limit_exceeded") -> ApiError:
    return ApiError(429, message, code=code, retry_after_s=retry_after_s)


def overloaded(message: str = "the server is overloaded; retry later",
               retry_after_s: float | None = None, code: str = "overloaded") -> ApiError:
    return ApiError(503, message, code=code, retry_after_s=retry_after_s)


def validation_param(loc: Iterable[Any], fields: Collection[str] | None = None) -> str | None:
    """A pydantic error location as OpenAI's `param`: ("body", "messages", 0, "content") →
    "messages.0.content"; None for the body as a whole. With `fields` (the models' field names),
    the location stops at the first part that is neither a field nor an index: pydantic puts the
    union member it tried there ("prompt", "list[str]", 1 → "prompt")."""
    parts = []
    for p in loc:
        if p in ("body", "query", "path", "header") and not parts:
            continue
        if fields is not None and not isinstance(p, int) and p not in fields:
            break
        parts.append(str(p))
    return ".".join(parts) or None


def from_validation_errors(errors: list[dict], fields: Collection[str] | None = None) -> ApiError:
    """The first pydantic error, named by its field (what a client most needs to fix)."""
    if not errors:
        return invalid("invalid request")
    e = errors[0]
    param = validation_param(e.get("loc", ()), fields)
    kind = e.get("type", "")
    ctx = e.get("ctx") or {}
    msg = str(ctx["error"]) if kind == "value_error" and "error" in ctx else str(e.get("msg", "invalid value"))
    if kind == "missing":
        return ApiError(400, f"missing required field {param!r}", param=param,
                        code="missing_required_parameter")
    return invalid(f"invalid value for {param!r}: {msg}" if param else msg, param)


# ---- handlers ---------------------------------------------------------------------------------------
async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return from_validation_errors(list(exc.errors())).response()


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    status = exc.status_code
    if status == 404:
        err = ApiError(404, f"no such route: {request.method} {request.url.path}",
                       code="unknown_url")
    elif status == 405:
        err = ApiError(405, f"method {request.method} is not allowed on {request.url.path}",
                       code="method_not_allowed")
    else:
        detail = exc.detail if isinstance(exc.detail, str) else "request refused"
        err = ApiError(status, detail)
    resp = err.response()
    for k, v in (exc.headers or {}).items():
        resp.headers.setdefault(k, v)
    return resp


# Redis down or not answering: the client should retry (503), never see a 500. REST and gRPC both.
STORE_ERRORS = (redis.ConnectionError, redis.TimeoutError)
STORE_FULL_RETRY_S = 5.0     # room comes back as requests end and stored responses expire


def store_unavailable() -> ApiError:
    return overloaded("the state store is unavailable; retry later", retry_after_s=1.0,
                      code="store_unavailable")


def store_full() -> ApiError:
    """Redis is above its memory watermark (scheduler/store/room.py), or refused a write for want
    of memory: new work waits until there is room; what runs finishes in the room left."""
    return overloaded("the state store is full; retry later", retry_after_s=STORE_FULL_RETRY_S,
                      code="store_full")


def store_refusal(exc: BaseException) -> ApiError | None:
    """What a client gets for a Redis error: 503 `store_unavailable` when Redis is away or
    refuses writes for a while (a replica, a disk it cannot write), 503 `store_full` when it
    refused a write for want of memory; None for any other error (a bug: a 500)."""
    if isinstance(exc, STORE_ERRORS) or write_refused(exc):
        return store_unavailable()
    if is_store_full(exc):
        return store_full()
    return None


async def store_call(remote: bool, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    """`fn(*args, **kw)`, a state store's call: on a thread when the store is `remote` (it may
    wait on the network, up to its timeout; never on the event loop), inline when it is a dict
    lookup; a store that is down, does not answer or refuses the write is the client's 503
    (`store_refusal`)."""
    try:
        return await asyncio.to_thread(fn, *args, **kw) if remote else fn(*args, **kw)
    except redis.RedisError as exc:
        refusal = store_refusal(exc)
        if refusal is None:
            raise
        raise refusal from None


async def _store_error(request: Request, exc: Exception) -> JSONResponse:
    refusal = store_refusal(exc)
    if refusal is None:
        return await _unexpected(request, exc)
    log.warning("state store refused %s %s: %s", request.method, request.url.path, exc)
    return refusal.response()


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return ApiError(500, "internal server error", code="internal_error").response()


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(redis.RedisError, _store_error)    # Redis down or full: 503
    app.add_exception_handler(Exception, _unexpected)
