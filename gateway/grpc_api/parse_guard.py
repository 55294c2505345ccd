"""A gRPC request message that does not parse gets INVALID_ARGUMENT in the API's words.

grpc.aio parses a message with the method's deserializer before the servicer runs, and answers
one that raises with UNKNOWN and the parser's exception text: a status the client cannot act
on, and library internals in its details. `ParseGuard`, a server interceptor, wraps each
deserializer so that a failure is handed to the method as a marker instead, and the method
then aborts with INVALID_ARGUMENT and a fixed message naming the method and the error code
REST gives an unparseable body (`invalid_json`'s counterpart: `invalid_message`).
"""
from __future__ import annotations

import inspect
from typing import Any, Awaitable, Callable

import grpc

MESSAGE = "the request message could not be parsed as {method}'s request type"


class _Unparseable:
    __slots__ = ()


_UNPARSEABLE = _Unparseable()


def _guarded(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse_or_mark(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception:                  # whatever the parser raises: the client's bytes
            return _UNPARSEABLE
    return parse_or_mark


def _refusing(behaviour: Callable[..., Any], method: str) -> Callable[..., Any]:
    async def refuse(context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, MESSAGE.format(method=method),
                            trailing_metadata=(("error-code", "invalid_message"),))

    if inspect.isasyncgenfunction(behaviour):     # a stream of yields (the others write)
        async def stream(request: Any, context: grpc.aio.ServicerContext):
            if request is _UNPARSEABLE:
                await refuse(context)
                return
            async for item in behaviour(request, context):
                yield item
        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request is _UNPARSEABLE:
            await refuse(context)
        return await behaviour(request, context)
    return call


class ParseGuard(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler                 # unknown method, raw bytes, or a client stream
        method = details.method.rsplit("/", 1)[-1]
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _refusing(handler.unary_stream, method),
                request_deserializer=_guarded(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            _refusing(handler.unary_unary, method),
            request_deserializer=_guarded(handler.request_deserializer),
            response_serializer=handler.response_serializer)
