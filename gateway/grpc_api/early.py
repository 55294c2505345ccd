"""Early refusals on the gRPC front: REST's (gateway/http/early_refusal.py), over the same book.

`EarlyGate`, a server interceptor, reads the key from a call's metadata as the servicer does,
and for a call of a gated method (`METHODS`) whose key holds a verdict of a kind its method
checks, answers with a handler that takes the request message unparsed (no deserializer), holds
the refusal as REST does, and aborts with the status the full path's refusal maps to
(`status_of`: RESOURCE_EXHAUSTED, the limiter's words, `error-code` and `retry-after` in the
trailers). Nothing of the servicer runs: no authentication, no store call, no message parsed.
A call without a verdict goes on to the servicer having cost one SHA-256 of its key.

The servicer notes its own refusals (`noted`), so a key refused on either front is refused
early on both: the book is one per replica, the REST app's.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable

import grpc

from gateway.errors import ApiError
from gateway.grpc_api.messages import api_key
from gateway.grpc_api.status import status_of
from gateway.http.early_refusal import EarlyRefusals
from gateway.tenancy.records import Tenant, presented_digest

# method -> (its route's kinds, as REST's: gateway/http/early_refusal.py; whether it streams)
METHODS = {"/specgate.v1.Generation/Generate": ("generate", False),
           "/specgate.v1.Generation/GenerateStream": ("generate", True),
           "/specgate.v1.Generation/Resume": ("follow", True)}


class EarlyGate(grpc.aio.ServerInterceptor):
    def __init__(self, refusals: EarlyRefusals) -> None:
        self.refusals = refusals

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        method = METHODS.get(details.method)
        key = api_key(details.invocation_metadata) if method is not None else None
        err = self.refusals.refused(presented_digest(key), method[0]) if key is not None else None
        if err is None:
            return await continuation(details)
        code, message, trailers = status_of(err)

        async def refuse(_request: bytes, context: grpc.aio.ServicerContext) -> None:
            await self.refusals.hold(err)
            await context.abort(code, message, trailing_metadata=trailers)

        # no deserializer: the message is handed over as bytes, never parsed
        if method[1]:
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)


def noted(refusals: EarlyRefusals | None, metadata: Any, tenant: Tenant | None, route: str,
          exc: BaseException) -> None:
    """A call's refusal by the full path, noted for its key (as REST's app notes its own)."""
    if refusals is None or tenant is None or not isinstance(exc, ApiError) or exc.status != 429:
        return
    key = api_key(metadata)
    if key is not None:
        refusals.note(presented_digest(key), tenant, route, exc)
