"""GET /health (the process answers) and GET /ready (the model is loaded, the loop runs, the
state store answers). Neither needs a key; neither says more than ready or not."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from gateway import errors
from gateway.http.deps import ServiceDep

router = APIRouter(tags=["health"])


@router.get("/health")
async def health() -> dict[str, Any]:
    return {"status": "ok"}


@router.get("/ready")
def ready(service: ServiceDep) -> dict[str, Any]:
    # A plain function (a worker thread): readiness may ping Redis, which must not block the event
    # loop. The ping is bounded by the client's timeout and cached briefly
    # (scheduler/store/redis_client.StoreProbe); the step loop's failing writes count too.
    if not service.ready():
        raise errors.overloaded("not ready: the model is loading or the state store is "
                                "unreachable", retry_after_s=5, code="not_ready")
    return {"status": "ready"}
