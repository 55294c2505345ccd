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
defaults and error messages match (gateway/grpc_api/messages.py converts both ways); the service
applies the model checks and the tenant's limits and raises `ApiError`, whose HTTP status becomes
a gRPC code (gateway/grpc_api/status.py). This module is the wiring: the server, its servicer's
three calls, and the health service.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.errors import ApiError
from gateway.followers import FollowerGate
from gateway.grpc_api.early import EarlyGate, noted
from gateway.grpc_api.messages import (arrived_input, authed_tenant, kept_alive, response_message,
                                       stream_messages)
from gateway.grpc_api.parse_guard import ParseGuard
from gateway.grpc_api.proto import specgate_pb2 as pb
from gateway.grpc_api.proto import specgate_pb2_grpc as pb_grpc
from gateway.grpc_api.status import status_of
from gateway.http.early_refusal import EarlyRefusals
from gateway.keepalive import KEEPALIVE_S
from gateway.replay import Cursor, Replayer
from gateway.service import EventStream, GenerationService
from gateway.tenancy.limits import Limiter
from gateway.tenancy.records import Tenant
from gateway.tenancy.tenants import TenantRegistry

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name   # "specgate.v1.Generation"

HEALTH_POLL_S = 1.0


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
                            followers: FollowerGate | None = None,
                            early: EarlyRefusals | None = None) -> GrpcServer:
    """Serve on `host:port` (0: a free port) on the running event loop, the service's.

    `tenants` authenticates keys (`authenticate(key) -> Tenant | None`). `limiter` is accepted so
    both fronts are built from the same parts, but the service applies the limits itself
    (`GenerationService.arrive`, then its admission), so gRPC and REST share one limiter through it.
    `max_message_bytes` caps a request message as `max_body_bytes` caps a REST body (None:
    gRPC's default, 4 MiB): gRPC refuses a larger one itself, with RESOURCE_EXHAUSTED, before
    it is parsed. `replayer`: reads the state store for `Resume` (None: Resume answers
    NOT_FOUND). `keepalive_s`: a waiting stream's keep-alive (module docstring; 0: none).
    `followers`: what a `Resume` costs its tenant (REST's resumes' gate; default: one over
    `limiter`). `early`: the REST app's early refusals, shared, so a key refused on either front
    is refused before any work on both (gateway/grpc_api/early.py; None: not gated)."""
    gates = [ParseGuard()] + ([EarlyGate(early)] if early is not None else [])
    server = grpc.aio.server(options=message_options(max_message_bytes) + keepalive_options(keepalive_s),
                             interceptors=gates)
    pb_grpc.add_GenerationServicer_to_server(
        GenerationServicer(service, tenants, replayer, max_message_bytes=max_message_bytes,
                           keepalive_s=keepalive_s,
                           followers=followers if followers is not None else FollowerGate(limiter),
                           early=early),
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
                 keepalive_s: float = KEEPALIVE_S, followers: FollowerGate | None = None,
                 early: EarlyRefusals | None = None):
        """`replayer`: reads the state store for `Resume` (None: Resume answers NOT_FOUND);
        `max_message_bytes`: the request cap (`arrived_input`); `keepalive_s`: a waiting stream's
        keep-alive message (0: none); `followers`: what a `Resume` costs its tenant (None:
        nothing); `early`: where a refusal for the tenant's limits is noted (None: nowhere)."""
        self.service = service
        self.tenants = tenants
        self.replayer = replayer
        self.max_message_bytes = max_message_bytes
        self.keepalive_s = keepalive_s
        self.followers = followers if followers is not None else FollowerGate(None)
        self.early = early

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        seen: list[Tenant] = []               # the caller's tenant, once authenticated
        try:
            inp = await arrived_input(self.service, self.tenants, request,
                                      context.invocation_metadata(), self.max_message_bytes,
                                      seen.append)
            out = await self.service.generate(inp)
            return response_message(out)
        except Exception as exc:            # every failure becomes a status (see `status_of`)
            self._note(context, seen, "generate", exc)
            await abort_with(context, exc)

    async def GenerateStream(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        # NOTE: context.write rather than an async-generator handler: a client's cancellation
        # arrives as CancelledError at whichever await is pending (the service's next event, or a
        # write), and either way passes the finally below, which closes the service's stream and
        # so cancels the request. A suspended generator would be closed only when collected.
        stream, seen = None, []
        try:
            inp = await arrived_input(self.service, self.tenants, request,
                                      context.invocation_metadata(), self.max_message_bytes,
                                      seen.append)
            stream = await self.service.open_stream(inp)                       # admits, or raises
            await context.send_initial_metadata((("request-id", stream.request_id),
                                                 ("service-tier", stream.service_tier)))
            await self._write(context, stream)
        except Exception as exc:
            self._note(context, seen, "generate", exc)
            await abort_with(context, exc)
        finally:
            if stream is not None:
                await stream.aclose()

    async def Resume(self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext):
        # the rest of a stream, from the state store (gateway/replay.py); closing it cancels
        # nothing: the request is not this call's. It is a request of its tenant's, charged and
        # holding a follower slot before anything else (gateway/followers.py)
        tenant = None
        try:
            tenant = await authed_tenant(self.tenants, context.invocation_metadata())
            async with self.followers.held(tenant):
                if self.replayer is None:
                    raise ApiError(404, "this deployment does not resume streams", code="not_found")
                record = await self.replayer.open(tenant, request.request_id)
                stream = self.replayer.stream(record, Cursor(tokens=request.after))
                await self._write(context, stream)
        except Exception as exc:
            self._note(context, [tenant] if tenant is not None else [], "follow", exc)
            await abort_with(context, exc)

    def _note(self, context: grpc.aio.ServicerContext, seen: list[Tenant], route: str,
              exc: BaseException) -> None:
        """A refusal for the tenant's limits noted for the call's key (gateway/grpc_api/early.py)."""
        if seen:
            noted(self.early, context.invocation_metadata(), seen[0], route, exc)

    async def _write(self, context: grpc.aio.ServicerContext, stream: EventStream) -> None:
        """A stream's events written as messages, with keep-alives while it waits."""
        async with contextlib.aclosing(kept_alive(stream_messages(stream),
                                                  self.keepalive_s)) as messages:
            async for message in messages:
                await context.write(message)


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
