"""A failure as a gRPC status: REST's refusal with its message kept, its type, param, code and
Retry-After in trailing metadata; anything else INTERNAL with REST's generic message.
"""
from __future__ import annotations

import grpc
import redis

from gateway.errors import ApiError, store_refusal

# REST status → gRPC code; a status not listed becomes INTERNAL.
# NOTE: 413 (the prompt does not fit the context) maps to INVALID_ARGUMENT, not RESOURCE_EXHAUSTED:
# the same request can never succeed, while clients read RESOURCE_EXHAUSTED as "back off and
# retry", which is what 429, and only 429, means here.
STATUS_CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
}
INTERNAL_MESSAGE = "internal server error"      # what REST answers an unexpected exception with


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """(code, details, trailing metadata) for a failure.

    An `ApiError` is a refusal written for clients: it keeps its message (REST's `error.message`),
    its type, param and code go in trailing metadata, and REST's `Retry-After` (whole seconds, on
    429 and 503) as `retry-after`. Any other exception is INTERNAL with REST's generic message:
    no exception text, no stack trace. A state store that is down, or refuses a write (full), is
    REST's 503 (`errors.store_refusal`): UNAVAILABLE.
    """
    if isinstance(exc, redis.RedisError):
        exc = store_refusal(exc) or exc
    if not isinstance(exc, ApiError):
        return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE, ()
    trailers = [("error-type", exc.type)]
    if exc.param:
        trailers.append(("error-param", exc.param))
    if exc.code:
        trailers.append(("error-code", exc.code))
    retry_after = exc.headers().get("Retry-After")
    if retry_after is not None:
        trailers.append(("retry-after", retry_after))
    return STATUS_CODES.get(exc.status, grpc.StatusCode.INTERNAL), exc.message, tuple(trailers)
