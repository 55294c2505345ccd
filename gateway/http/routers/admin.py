"""The admin API: add, replace and remove tenants and rotate their keys, with no restart.

Every route needs an admin key (`Authorization: Bearer <admin key>`); a tenant's key is not one.
Responses never contain a stored key or digest: a key is shown once, when it is generated.

    GET    /admin/tenants                   {"object": "list", "data": [tenant, ...]}
    POST   /admin/tenants                   body: one tenant as in the tenants file (api_keys
                                            optional); 201 new / 200 replaced; "api_key" when one
                                            was generated (a new tenant given no keys)
    DELETE /admin/tenants/{name}            {"id": name, "object": "tenant", "deleted": true};
                                            the engine frees the tenant's caches and /metrics
                                            drops its series
    POST   /admin/tenants/{name}/rotate-key {"tenant": name, "api_key": "sk-…"}

Errors are OpenAI error JSON (gateway.errors): 401 missing or bad admin key, 404 unknown tenant,
400 invalid body, naming the field in `param`. The handlers doing I/O are plain functions, so
FastAPI runs them on its thread pool and a store round trip never blocks the event loop.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Header, Request
from fastapi.responses import JSONResponse

from gateway.errors import ApiError, invalid, unauthorized
from gateway.tenancy.config import TenantsConfigError, parse_tenant
from gateway.tenancy.records import tenant_to_dict
from gateway.tenancy.tenants import TenantRegistry


log = logging.getLogger(__name__)


def get_registry(request: Request) -> TenantRegistry:
    return request.app.state.tenants


RegistryDep = Annotated[TenantRegistry, Depends(get_registry)]


def require_admin(registry: RegistryDep,
                  authorization: Annotated[str | None, Header()] = None) -> None:
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise unauthorized("missing admin key: send 'Authorization: Bearer <admin key>'")
    if not registry.is_admin(key.strip()):
        raise unauthorized("invalid admin key")


router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])


def _tenant_json(tenant) -> dict[str, Any]:
    return {"object": "tenant", **tenant_to_dict(tenant)}


def _not_found(name: str) -> ApiError:
    return ApiError(404, f"no tenant named {name!r}", param="name", code="tenant_not_found")


@router.get("/tenants")
def list_tenants(registry: RegistryDep) -> dict[str, Any]:
    return {"object": "list", "data": [_tenant_json(t) for t in registry.list()]}


@router.post("/tenants")
def put_tenant(registry: RegistryDep, body: Annotated[Any, Body()]) -> JSONResponse:
    try:
        tenant, digests = parse_tenant(body)
    except TenantsConfigError as exc:
        raise invalid(str(exc), param=exc.field or None, code="invalid_tenant") from None
    is_new = registry.get(tenant.name) is None
    try:
        registry.put_digests(tenant, digests or None)
    except ValueError as exc:       # a given key already belongs to another tenant
        raise invalid(f"api_keys: {exc}", param="api_keys", code="api_key_conflict") from None
    out: dict[str, Any] = {"tenant": _tenant_json(tenant)}
    if is_new and not digests:
        out["api_key"] = registry.rotate_key(tenant.name)   # shown this once
    return JSONResponse(out, status_code=201 if is_new else 200)


@router.delete("/tenants/{name}")
async def delete_tenant(request: Request, registry: RegistryDep, name: str) -> dict[str, Any]:
    """Remove the tenant, then have the engine drop its caches and /metrics its series (the
    service's `forget_tenant`; in Ray mode the scheduler replica's). A tenant created again under
    the name gets a new id (gateway/tenancy/tenants.py), so it never meets the old caches even
    where this replica cannot reach them (another gateway replica's engine keeps them until its
    own eviction)."""
    removed = await asyncio.to_thread(registry.remove, name)      # a store round trip
    if removed is None:
        raise _not_found(name)
    service = getattr(request.app.state, "service", None)
    if service is not None:
        try:
            await service.forget_tenant(removed.id, removed.name)
        except Exception:                  # removed all the same; only the freeing is late
            log.exception("tenant %r removed, but its caches and series were not dropped", name)
    return {"id": name, "object": "tenant", "deleted": True}


@router.post("/tenants/{name}/rotate-key")
def rotate_key(registry: RegistryDep, name: str) -> dict[str, Any]:
    try:
        return {"tenant": name, "api_key": registry.rotate_key(name)}
    except KeyError:
        raise _not_found(name) from None
