"""GET /v1/models and /v1/models/{id}: the served models this API key may use (and no others)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from gateway import errors
from gateway.http.deps import ServiceDep, TenantDep

router = APIRouter(tags=["models"])


def _model(model_id: str, created: int) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "specgate"}


@router.get("/v1/models")
async def list_models(tenant: TenantDep, service: ServiceDep) -> dict[str, Any]:
    created = service.started_s
    return {"object": "list", "data": [_model(m, created) for m in service.models
                                       if tenant.allows_model(m)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, tenant: TenantDep, service: ServiceDep) -> dict[str, Any]:
    # A model this key may not use is reported as missing: a key learns nothing beyond its own.
    if model_id not in service.models or not tenant.allows_model(model_id):
        raise errors.unknown_model(model_id)
    return _model(model_id, service.started_s)
