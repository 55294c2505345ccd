"""GET /metrics: Prometheus text, for an admin key or the metrics key only (the figures cover
every tenant). The metrics key (`metrics_key`) lets Prometheus scrape without an admin key."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from gateway.http.deps import MetricsDep, MetricsReaderDep

router = APIRouter(tags=["metrics"])


@router.get("/metrics")
async def metrics(_: MetricsReaderDep, registry: MetricsDep) -> Response:
    body, content_type = await registry.exposition()
    return Response(body, media_type=content_type)
