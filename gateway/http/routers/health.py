"""GET /health (the process answers) and GET /ready (the model is loaded, the loop runs, the
state store answers and has room). Neither needs a key; /ready says why it is not ready, no more."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from gateway import errors
from gateway.http.deps import ServiceDep

router = APIRouter(tags=["health"])


@router.get("/health")
async def health() -> dict[str, Any]:
    return {"status": "ok"}


@router.get("/ready")
def ready(request: Request, service: ServiceDep) -> dict[str, Any]:
    # A plain function (a worker thread): readiness may ping Redis and read its memory, which must
    # not block the event loop. Both are bounded by the client's timeout and cached briefly
    # (scheduler/store/redis_client.StoreProbe, scheduler/store/room.StoreRoom); the step loop's
    # failing writes count too. Redis's memory is read after its ping has answered (a Redis that
    # does not answer costs one timeout, not two), so the reason is the reading `ready()` made.
    if service.ready():
        return {"status": "ready"}
    room = request.app.state.store_room
    if room is not None and room.full():
        raise errors.overloaded("not ready: the state store is full (Redis is above its memory "
                                "watermark); new requests are refused until it has room",
                                retry_after_s=errors.STORE_FULL_RETRY_S, code="store_full")
    raise errors.overloaded("not ready: the model is loading or the state store is "
                            "unreachable", retry_after_s=5, code="not_ready")
