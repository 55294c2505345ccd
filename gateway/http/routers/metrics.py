"""GET /metrics: Prometheus text, for an admin key only (the figures cover every tenant)."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from gateway.http.deps import AdminDep, MetricsDep

router = APIRouter(tags=["metrics"])


@router.get("/metrics")
async def metrics(_: AdminDep, registry: MetricsDep) -> Response:
    body, content_type = await registry.exposition()
    return Response(body, media_type=content_type)
