"""Ray Serve mode's ingress replica: the embedded mode's FastAPI app over a `RemoteService`, and
the gRPC service's methods, which Serve's gRPC proxy calls by name.

What an ingress replica imports is this module and what it imports: no model code and no torch
(tests/unit/test_architecture.py checks it in a fresh interpreter). Its tokenizer, which resumed
streams and the Responses API detokenize with, is the scheduler replica's own, sent over once when
the app is built: the ingress loads no model files, and detokenizes exactly as the scheduler
tokenizes.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from fastapi import FastAPI

from gateway.assembly.replica import scheduler_prefix
from gateway.assembly.serving import responses_service, room_of
from gateway.followers import FollowerGate
from gateway.grpc_api.messages import (arrived_input, authed_tenant, kept_alive, response_message,
                                       stream_messages)
from gateway.grpc_api.status import status_of
from gateway.http.app import build_app
from gateway.metrics import GatewayMetrics
from gateway.ray_serve.remote import RemoteService
from gateway.ray_serve.replica_secrets import INGRESS_READS, settings_in_replica
from gateway.replay import Cursor, Replayer
from gateway.service import GenerateInput
from gateway.tenancy.limits import Limiter
from gateway.tenancy.tenants import TenantRegistry
from scheduler.store import open_store

log = logging.getLogger(__name__)

__all__ = ["IngressServer", "SchedulerMetrics", "GRPC_SERVICER"]

GRPC_SERVICER = "gateway.grpc_api.proto.specgate_pb2_grpc.add_GenerationServicer_to_server"


class IngressServer:
    """An ingress replica: the embedded mode's FastAPI app, its service remote; and the gRPC
    service's methods, which Serve's gRPC proxy calls by name (`Generate`, `GenerateStream`,
    `Resume`, with the call's metadata in `grpc_context`) when the Serve config's `grpc_options`
    names gateway/proto's servicer (`GRPC_SERVICER`)."""

    def __init__(self, settings: dict[str, Any], scheduler: Any) -> None:
        # the keys, the key pepper and the Redis URL: from its node's environment, never Serve's
        self.settings = s = settings_in_replica(settings, INGRESS_READS)
        self.scheduler = scheduler
        # One registry and limiter per replica, shared by REST and gRPC; the ingress replicas
        # apply the tenants file and the configured admin keys (the scheduler's opens the store
        # alone: `assemble(..., configure_tenants=False)`). Requests are charged to their
        # tenant's rpm here, as they arrive.
        self.tenants = TenantRegistry.from_settings(s)
        self.limiter = Limiter(s.redis_url, s.store_prefix, timeout_s=s.redis_timeout_s,
                               lease_s=s.concurrency_lease_s)
        # Redis's memory against its watermark: new requests are refused here above it
        self.room = room_of(s) if s.redis_url else None
        self.service = RemoteService(scheduler, models=[s.model_id], limiter=self.limiter,
                                     store_full=self.room.full if self.room else None)
        # followers (resumes, streamed GETs of responses) are charged here, where they hold a
        # slot of this replica's (gateway/followers.py), before anything reaches the scheduler
        self.followers = FollowerGate(self.limiter, s.max_followers_per_tenant)
        # the scheduler's state store, read only (opening it does no I/O)
        self.records = open_store(s.redis_url, scheduler_prefix(s), ended_ttl_s=s.ended_ttl_s,
                                  timeout_s=s.redis_timeout_s)
        self.replayer: Replayer | None = None          # once the app is built (the tokenizer)
        self._refresher = asyncio.get_event_loop().create_task(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        while True:
            await self.service.refresh()
            await asyncio.sleep(1.0 if self.service.ready() else 0.2)

    async def __serve_build_asgi_app__(self) -> FastAPI:
        # NOTE: waits for the scheduler replica (it answers once its model is described): an
        # ingress replica started while the scheduler is down serves nothing until it is back,
        # which without a scheduler it could not do anyway.
        tokenizer = await self.scheduler.tokenizer.remote()
        # resumed streams and the Responses API read what they serve from Redis (the scheduler's
        # records, the stored responses), so any ingress replica, or a new one, answers
        self.replayer = Replayer(self.records, tokenizer)
        responses = responses_service(self.settings, self.service, self.records, tokenizer, local=False)
        return build_app(self.settings, self.service, self.tenants, self.limiter,
                         SchedulerMetrics(self.scheduler), replayer=self.replayer,
                         responses=responses, store_room=self.room, followers=self.followers)

    # ---- gRPC (gateway/grpc_api/proto/specgate.proto), as gateway.grpc_api.server serves it in embedded mode ----

    async def Generate(self, request, grpc_context):
        try:
            inp = await self._arrived(request, grpc_context)
            return response_message(await self.service.generate(inp))
        except Exception as exc:
            _fail_grpc(grpc_context, exc)

    async def GenerateStream(self, request, grpc_context):
        stream = None
        try:
            stream = await self.service.open_stream(await self._arrived(request, grpc_context))
            async for message in kept_alive(stream_messages(stream), self.settings.stream_keepalive_s):
                yield message
        except Exception as exc:
            _fail_grpc(grpc_context, exc)
        finally:
            if stream is not None:
                await stream.aclose()

    async def _arrived(self, request, grpc_context) -> GenerateInput:
        # Serve's proxy takes messages up to its own cap (RAY_SERVE_GRPC_MAX_MESSAGE_SIZE, which
        # the chart sets): the body cap is applied here, before any work on the message
        return await arrived_input(self.service, self.tenants, request,
                                   grpc_context.invocation_metadata(), self.settings.max_body_bytes)

    async def Resume(self, request, grpc_context):
        try:
            tenant = await authed_tenant(self.tenants, grpc_context.invocation_metadata())
            async with self.followers.held(tenant):
                record = await self.replayer.open(tenant, request.request_id)
                stream = self.replayer.stream(record, Cursor(tokens=request.after))
                async with contextlib.aclosing(kept_alive(stream_messages(stream),
                                                          self.settings.stream_keepalive_s)) as messages:
                    async for message in messages:
                        yield message
        except Exception as exc:
            _fail_grpc(grpc_context, exc)


def _fail_grpc(grpc_context, exc: Exception):
    """End a gRPC call with the status embedded mode gives the same failure (`status_of`): Serve's
    proxy answers with the code and details set on the context when the method raises."""
    code, details, trailers = status_of(exc)
    if code.name == "INTERNAL":
        log.error("gRPC: request failed", exc_info=exc)
    grpc_context.set_code(code)
    grpc_context.set_details(details)
    grpc_context.set_trailing_metadata(trailers)
    raise RuntimeError(details) from None


class SchedulerMetrics(GatewayMetrics):
    """An ingress replica's metrics: GET /metrics serves the scheduler replica's, where requests,
    tokens, latencies and steps are counted (one scheduler: one consistent view, whichever
    ingress replica Prometheus reaches)."""

    def __init__(self, scheduler: Any) -> None:
        super().__init__()
        self.scheduler = scheduler

    async def exposition(self) -> tuple[bytes, str]:
        return await self.scheduler.metrics.remote()
