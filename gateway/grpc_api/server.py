"""The gRPC front: `specgate.v1.Generation` (gateway/grpc_api/proto/specgate.proto) over the same
`GenerationService` as REST, plus the standard health service and server reflection.

A `grpc.aio` server on the event loop that runs the service (and uvicorn), so a handler awaits
the service directly, and a client that cancels (or whose deadline passes) cancels the request
as a disconnect does in REST. A stream that waits (queued, or a resumed request not yet running)
sends a keep-alive every `keepalive_s` seconds in which it sends nothing else, two kinds:
an empty `GenerateDelta` (no text, no token ids: a client that joins deltas, or counts their
token ids for `Resume.after`, is unchanged by it), which proxies that time out a stream on its
data (Envoy's stream idle timeout, nginx's grpc_read_timeout) see; and HTTP/2 pings at the same
interval, which load balancers that time out the connection see, and which find a client that
vanished without closing. Everything else is REST's, by construction: the API key is read
from metadata (`authorization: Bearer <key>`, or `x-api-key: <key>`) and checked by the same
tenant registry; a request is validated by REST's request models (`gateway.schemas`), so sizes,
defaults and error messages match; the service applies the model checks and the tenant's limits
and raises `ApiError`, whose HTTP status becomes a gRPC code (`STATUS_CODES`).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, AsyncGenerator, AsyncIterator, Callable, Protocol

import grpc
import pydantic
import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway import errors, schemas
from gateway.http.deps import field_names
from gateway.keepalive import KEEPALIVE_S, with_keepalive
from gateway.errors import ApiError, store_refusal
from gateway.followers import FollowerGate
from gateway.grpc_api.proto import specgate_pb2 as pb
from gateway.grpc_api.proto import specgate_pb2_grpc as pb_grpc
from gateway.replay import Cursor, Replayer
from gateway.service import EventStream, GenerateInput, GenerateOutput, GenerationService
from gateway.tenancy.records import Tenant
from gateway.tenancy.limits import Limiter
from gateway.tenancy.tenants import TenantRegistry

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name   # "specgate.v1.Generation"

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
HEALTH_POLL_S = 1.0
# what a waiting stream sends as its keep-alive: a delta of no text and no tokens
KEEPALIVE_MESSAGE = pb.GenerateStreamResponse(delta=pb.GenerateDelta())
_FIELDS = {m: field_names(m) for m in (schemas.CompletionRequest, schemas.ChatRequest)}


@dataclass
class GrpcServer:
    """A started server. `port` is the bound port (useful with port 0). `stop` first reports
    NOT_SERVING to health checks, then lets calls in flight finish for `grace` seconds."""
    server: grpc.aio.Server
    port: int
    health: "_Health"
    _health_task: asyncio.Task

    async def stop(self, grace: float | None = 5.0) -> None:
        self._health_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._health_task
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def start_grpc_server(service: GenerationService, tenants: TenantRegistry,
                            limiter: Limiter | None, port: int, host: str = "127.0.0.1", *,
                            max_message_bytes: int | None = None,
                            replayer: Replayer | None = None,
                            keepalive_s: float = KEEPALIVE_S,
                            followers: FollowerGate | None = None) -> GrpcServer:
    """Serve on `host:port` (0: a free port) on the running event loop, the service's.

    `tenants` authenticates keys (`authenticate(key) -> Tenant | None`). `limiter` is accepted so
    both fronts are built from the same parts, but the service applies the limits itself
    (`GenerationService.arrive`, then its admission), so gRPC and REST share one limiter through it.
    `max_message_bytes` caps a request message as `max_body_bytes` caps a REST body (None:
    gRPC's default, 4 MiB): gRPC refuses a larger one itself, with RESOURCE_EXHAUSTED, before
    it is parsed. `replayer`: reads the state store for `Resume` (None: Resume answers
    NOT_FOUND). `keepalive_s`: a waiting stream's keep-alive (module docstring; 0: none).
    `followers`: what a `Resume` costs its tenant (REST's resumes' gate; default: one over
    `limiter`)."""
    server = grpc.aio.server(options=message_options(max_message_bytes) + keepalive_options(keepalive_s))
    pb_grpc.add_GenerationServicer_to_server(
        GenerationServicer(service, tenants, replayer, max_message_bytes=max_message_bytes,
                           keepalive_s=keepalive_s,
                           followers=followers if followers is not None else FollowerGate(limiter)),
        server)
    health_servicer = _Health(service.ready)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"gRPC: cannot listen on {host}:{port}")
    await health_servicer.refresh()
    await server.start()
    follow = asyncio.get_running_loop().create_task(health_servicer.follow(), name="grpc-health")
    log.info("gRPC: serving %s on %s:%d", SERVICE_NAME, host, bound)
    return GrpcServer(server, bound, health_servicer, follow)


def keepalive_options(keepalive_s: float) -> list[tuple[str, int]]:
    """The server's HTTP/2 pings: every `keepalive_s` seconds while calls are open, without
    gRPC's default cap of two pings between data frames (which would stop them on a connection
    whose streams have long waits); a peer that does not answer one is dropped, and its calls
    cancelled, after gRPC's default 20 s."""
    if keepalive_s <= 0:
        return []
    return [("grpc.keepalive_time_ms", max(1, round(keepalive_s * 1000))),
            ("grpc.http2.max_pings_without_data", 0)]


def message_options(max_message_bytes: int | None) -> list[tuple[str, int]]:
    """The server's cap on a received message. Only received: what it sends is bounded by the
    model's context, not by the client, and a cap there would fail a long completion after its
    work was done."""
    return [] if max_message_bytes is None else [("grpc.max_receive_message_length", max_message_bytes)]


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, service: GenerationService, tenants: TenantRegistry,
                 replayer: Replayer | None = None, *, max_message_bytes: int | None = None,
                 keepalive_s: float = KEEPALIVE_S, followers: FollowerGate | None = None):
        """`replayer`: reads the state store for `Resume` (None: Resume answers NOT_FOUND);
        `max_message_bytes`: the request cap (`arrived_input`); `keepalive_s`: a waiting stream's
        keep-alive message (0: none); `followers`: what a `Resume` costs its tenant (None:
        nothing)."""
        self.service = service
        self.tenants = tenants
        self.replayer = replayer
        self.max_message_bytes = max_message_bytes
        self.keepalive_s = keepalive_s
        self.followers = followers if followers is not None else FollowerGate(None)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            inp = await arrived_input(self.service, self.tenants, request,
                                      context.invocation_metadata(), self.max_message_bytes)
            out = await self.service.generate(inp)
            return response_message(out)
        except Exception as exc:            # every failure becomes a status (see `status_of`)
            await abort_with(context, exc)

    async def GenerateStream(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        # NOTE: context.write rather than an async-generator handler: a client's cancellation
        # arrives as CancelledError at whichever await is pending (the service's next event, or a
        # write), and either way passes the finally below, which closes the service's stream and
        # so cancels the request. A suspended generator would be closed only when collected.
        stream = None
        try:
            inp = await arrived_input(self.service, self.tenants, request,
                                      context.invocation_metadata(), self.max_message_bytes)
            stream = await self.service.open_stream(inp)                       # admits, or raises
            await context.send_initial_metadata((("request-id", stream.request_id),
                                                 ("service-tier", stream.service_tier)))
            async with contextlib.aclosing(kept_alive(stream_messages(stream),
                                                      self.keepalive_s)) as messages:
                async for message in messages:
                    await context.write(message)
        except Exception as exc:
            await abort_with(context, exc)
        finally:
            if stream is not None:
                await stream.aclose()


    async def Resume(self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext):
        # the rest of a stream, from the state store (gateway/replay.py); closing it cancels
        # nothing: the request is not this call's. It is a request of its tenant's, charged and
        # holding a follower slot before anything else (gateway/followers.py)
        try:
            tenant = await authed_tenant(self.tenants, context.invocation_metadata())
            async with self.followers.held(tenant):
                if self.replayer is None:
                    raise ApiError(404, "this deployment does not resume streams", code="not_found")
                record = await self.replayer.open(tenant, request.request_id)
                stream = self.replayer.stream(record, Cursor(tokens=request.after))
                async with contextlib.aclosing(kept_alive(stream_messages(stream),
                                                          self.keepalive_s)) as messages:
                    async for message in messages:
                        await context.write(message)
        except Exception as exc:
            await abort_with(context, exc)


async def authed_tenant(tenants: TenantRegistry, metadata: Any) -> Tenant:
    """The caller's tenant (401 without a known key), off the event loop when tenants live in
    Redis."""
    if tenants.remote:
        tenant = await asyncio.to_thread(tenants.authenticate, api_key(metadata))
    else:
        tenant = tenants.authenticate(api_key(metadata))
    if tenant is None:
        raise errors.unauthorized()
    return tenant


class Arrivals(Protocol):
    """What `arrived_input` charges an arriving request to: `GenerationService`, or Ray mode's
    `RemoteService` (the ingress's own limiter)."""
    async def arrive(self, tenant: Tenant) -> None: ...


async def arrived_input(service: Arrivals, tenants: TenantRegistry, request: pb.GenerateRequest,
                        metadata: Any, max_bytes: int | None) -> GenerateInput:
    """A request as it arrives, in REST's order: its size against the body cap (413, before
    anything: in Ray mode Serve's proxy takes messages up to its own cap, so this is ours), the
    caller's tenant (401), the request charged to the tenant's requests per minute (429; from
    here on every refusal has cost the tenant a request), then REST's validation, off the event
    loop (its work grows with the message)."""
    if max_bytes is not None and request.ByteSize() > max_bytes:
        raise errors.too_large(f"the request message is larger than {max_bytes} bytes")
    tenant = await authed_tenant(tenants, metadata)
    await service.arrive(tenant)
    return await asyncio.to_thread(generate_input, request, tenant)


async def stream_messages(stream: EventStream) -> AsyncIterator[pb.GenerateStreamResponse]:
    """A service stream's events as GenerateStream messages: deltas, then the final response (and,
    as REST does, an error after the final of a request the engine failed)."""
    async for item in stream:
        if isinstance(item, GenerateOutput):
            yield pb.GenerateStreamResponse(final=response_message(item))
            if item.finish_reason == "error":
                raise generation_failed()
        else:
            yield pb.GenerateStreamResponse(delta=pb.GenerateDelta(text=item.text, token_ids=item.token_ids))


def kept_alive(messages: AsyncGenerator[pb.GenerateStreamResponse, None],
               keepalive_s: float) -> AsyncGenerator[pb.GenerateStreamResponse, None]:
    """`messages`, and `KEEPALIVE_MESSAGE` each time `keepalive_s` seconds pass without one."""
    return with_keepalive(messages, keepalive_s, KEEPALIVE_MESSAGE)


def api_key(metadata: Any) -> str | None:
    """The key from `authorization: Bearer <key>`, else from `x-api-key: <key>`."""
    pairs = {k.lower(): v for k, v in (metadata or ()) if isinstance(v, str)}
    scheme, _, key = pairs.get("authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return key.strip()
    return pairs.get("x-api-key", "").strip() or None


def generate_input(request: pb.GenerateRequest, tenant: Tenant) -> GenerateInput:
    """Proto → the REST body it stands for → REST's request model → `GenerateInput`: the same
    size limits, defaults and validation errors as /v1/completions and /v1/chat/completions.
    Fields left unset are left out, so REST's defaults apply."""
    body: dict[str, Any] = {"model": request.model}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        if request.HasField(name):
            body[name] = getattr(request, name)
    if request.stop:
        body["stop"] = list(request.stop)
    if request.user:
        body["user"] = request.user
    if request.service_tier:
        body["service_tier"] = request.service_tier
    speculation = {rest: getattr(request, name) for rest, name in
                   (("enabled", "speculation"), ("max_tree_tokens", "max_tree_tokens"))
                   if request.HasField(name)}
    if speculation:
        body["speculation"] = speculation
    which = request.WhichOneof("input")
    model: type[schemas.CompletionRequest] | type[schemas.ChatRequest] = schemas.CompletionRequest
    if which == "prompt":
        body["prompt"] = request.prompt
    elif which == "prompt_ids":
        body["prompt"] = list(request.prompt_ids.ids)
    elif which == "messages":
        model = schemas.ChatRequest
        if any(m.role == "tool" for m in request.messages.messages):
            # NOTE: the proto carries no tools, tool calls nor tool_call_id (yet): refused by
            # name rather than as a malformed message
            raise errors.invalid("tool calling is not available over gRPC; use POST "
                                 "/v1/chat/completions", "messages", code="unsupported_parameter")
        body["messages"] = [{"role": m.role, "content": m.content} for m in request.messages.messages]
    else:
        raise ApiError(400, "send one of 'prompt', 'messages' or 'prompt_ids'", param="prompt",
                       code="missing_required_parameter")
    try:
        return model.model_validate(body).to_input(tenant)
    except pydantic.ValidationError as exc:
        raise errors.from_validation_errors(exc.errors(include_url=False), _FIELDS[model]) from None


def response_message(out: GenerateOutput) -> pb.GenerateResponse:
    s = out.speculation
    return pb.GenerateResponse(
        id=out.request_id, text=out.text, token_ids=out.token_ids, finish_reason=out.finish_reason,
        usage=pb.Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                       total_tokens=out.prompt_tokens + out.completion_tokens),
        speculation=pb.SpeculationStats(drafted=s.drafted, accepted=s.accepted, steps=s.steps, tau=s.tau),
        service_tier=out.service_tier)


def generation_failed() -> ApiError:
    """What `GenerationService.generate` raises for a request the engine failed."""
    return ApiError(500, "generation failed; retry the request", code="generation_failed")


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


async def abort_with(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    if isinstance(exc, grpc.aio.AbortError):       # the call is already aborted
        raise exc
    code, details, trailers = status_of(exc)
    if code is grpc.StatusCode.INTERNAL and not isinstance(exc, ApiError):
        log.error("gRPC: unhandled error in %s", SERVICE_NAME, exc_info=exc)
    await context.abort(code, details, trailing_metadata=trailers)


class _Health(health.aio.HealthServicer):
    """The standard health service: SERVING, for "" and for specgate.v1.Generation, exactly when
    `service.ready()`. `Check` asks afresh; `Watch` callers hear of changes through `follow`."""

    def __init__(self, ready: Callable[[], bool]):
        super().__init__()
        self._ready = ready
        self._status: int | None = None

    async def refresh(self) -> None:
        # ready() may ping Redis: ask on a worker thread, never on the event loop.
        ready = await asyncio.to_thread(_ready_or_false, self._ready)
        status = (health_pb2.HealthCheckResponse.SERVING if ready
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        if status != self._status:
            self._status = status
            for name in ("", SERVICE_NAME):
                await self.set(name, status)

    async def follow(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            await self.refresh()

    async def Check(self, request, context):
        await self.refresh()
        return await super().Check(request, context)


def _ready_or_false(ready: Callable[[], bool]) -> bool:
    try:
        return bool(ready())
    except Exception:
        log.warning("gRPC health: ready() raised", exc_info=True)
        return False
