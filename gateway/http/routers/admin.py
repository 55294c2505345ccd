"""The admin API: add, replace and remove tenants, rotate their keys and revoke admin keys, with no
restart.

Every route needs an admin key (`Authorization: Bearer <admin key>`): without one (or with an
unknown key) 401, with a tenant's key or the metrics key 403, both before the body is read.
Responses never contain a stored key or digest: a key is shown once, when it is generated.

    GET    /admin/tenants                   {"object": "list", "data": [tenant, ...]}
    POST   /admin/tenants                   body: one tenant as in the tenants file (api_keys
                                            optional); 201 new / 200 replaced; "api_key" when one
                                            was generated (a new tenant given no keys)
    DELETE /admin/tenants/{name}            {"id": name, "object": "tenant", "deleted": true};
                                            the engine frees the tenant's caches, /metrics
                                            drops its series, its stored responses go
    POST   /admin/tenants/{name}/rotate-key {"tenant": name, "api_key": "sk-…", "grace_s": s}
                                            ?grace_s=S: the old keys keep working S seconds more
                                            (default DEFAULT_GRACE_S; 0 = they stop now)
    POST   /admin/admin-keys/revoke         body {"key": "<admin key, or its sha256:<hex> digest>"}
                                            {"object": "admin_key", "revoked": true}

Errors are OpenAI error JSON (gateway.errors): 401 missing or bad admin key, 403 not an admin's
key, 404 unknown tenant or admin key, 400 invalid body (naming the field in `param`), 409 a key
that is already an admin key or the metrics key, or a revocation that would lock the caller (or
every admin) out. The handlers doing I/O are plain functions, so FastAPI runs them on its
thread pool and a store round trip never blocks the event loop.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse

from gateway.errors import ApiError, invalid
from gateway.http.deps import TenantsDep, bearer_key, json_value, require_admin
from gateway.tenancy.config import TenantsConfigError, parse_tenant
from gateway.tenancy.records import tenant_to_dict
from gateway.tenancy.tenant_store import LAST_ADMIN, NOT_ADMIN, OWN_KEY
from gateway.tenancy.tenants import MAX_GRACE_S, KeyConflict

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 300.0     # long enough to roll a key out to clients, short enough to end a leak

# Auth is a router dependency, so it runs before the body dependency of any route.
router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])
BodyDep = Annotated[Any, Depends(json_value)]


def _body_schema(schema: dict) -> dict:
    """`openapi_extra` for a body read by a dependency (FastAPI cannot see it)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _tenant_json(tenant) -> dict[str, Any]:
    return {"object": "tenant", **tenant_to_dict(tenant)}


def _not_found(name: str) -> ApiError:
    return ApiError(404, f"no tenant named {name!r}", param="name", code="tenant_not_found")


@router.get("/tenants")
def list_tenants(registry: TenantsDep) -> dict[str, Any]:
    return {"object": "list", "data": [_tenant_json(t) for t in registry.list()]}


@router.post("/tenants", openapi_extra=_body_schema({"type": "object"}))
def put_tenant(registry: TenantsDep, body: BodyDep) -> JSONResponse:
    try:
        tenant, digests = parse_tenant(body)
    except TenantsConfigError as exc:
        raise invalid(str(exc), param=exc.field or None, code="invalid_tenant") from None
    is_new = registry.get(tenant.name) is None
    try:
        registry.put_digests(tenant, digests or None)
    except KeyConflict as exc:
        if exc.owner == "tenant":
            raise invalid(f"api_keys: {exc}", param="api_keys", code="api_key_conflict") from None
        raise ApiError(409, f"api_keys: {exc}; a key is a tenant's or an admin's, never both",
                       param="api_keys", code=f"{exc.owner}_key_conflict") from None
    out: dict[str, Any] = {"tenant": _tenant_json(tenant)}
    if is_new and not digests:
        out["api_key"] = registry.rotate_key(tenant.name)   # shown this once
    return JSONResponse(out, status_code=201 if is_new else 200)


@router.delete("/tenants/{name}")
async def delete_tenant(request: Request, registry: TenantsDep, name: str) -> dict[str, Any]:
    """Remove the tenant, then have the engine drop its caches and /metrics its series (the
    service's `forget_tenant`; in Ray mode the scheduler replica's), and its stored responses go
    (`ResponseService.forget_tenant`). A tenant created again under the name gets a new id
    (gateway/tenancy/tenants.py), so it never meets the old caches even where this replica
    cannot reach them (another gateway replica's engine keeps them until its own eviction)."""
    removed = await asyncio.to_thread(registry.remove, name)      # a store round trip
    if removed is None:
        raise _not_found(name)
    service = request.app.state.service                # None: an app over the registry alone
    if service is not None:
        try:
            await service.forget_tenant(removed.id, removed.name)
        except Exception:                  # removed all the same; only the freeing is late
            log.exception("tenant %r removed, but its caches and series were not dropped", name)
    responses = request.app.state.responses
    if responses is not None:
        try:
            await responses.forget_tenant(removed.id)
        except Exception:                  # removed all the same: the tenant sweep drops them
            log.exception("tenant %r removed, but its stored responses were not dropped", name)
    return {"id": name, "object": "tenant", "deleted": True}


@router.post("/tenants/{name}/rotate-key")
def rotate_key(registry: TenantsDep, name: str,
               grace_s: Annotated[float, Query(ge=0, le=MAX_GRACE_S)] = DEFAULT_GRACE_S
               ) -> dict[str, Any]:
    try:
        return {"tenant": name, "api_key": registry.rotate_key(name, grace_s), "grace_s": grace_s}
    except KeyError:
        raise _not_found(name) from None


_REVOKE_SCHEMA = {"type": "object", "required": ["key"], "additionalProperties": False,
                  "properties": {"key": {"type": "string", "minLength": 1}}}


@router.post("/admin-keys/revoke", openapi_extra=_body_schema(_REVOKE_SCHEMA))
def revoke_admin_key(registry: TenantsDep, request: Request, body: BodyDep) -> dict[str, Any]:
    key = body.get("key") if isinstance(body, dict) else None
    if not isinstance(body, dict) or set(body) != {"key"} or not isinstance(key, str) or not key:
        raise invalid("send {\"key\": \"<admin key, or its sha256:<hex> digest>\"}", param="key",
                      code="invalid_body")
    try:
        result = registry.revoke_admin_key(key, bearer_key(request) or "")
    except ValueError as exc:               # "sha256:" not followed by 64 hex digits
        raise invalid(f"key: {exc}", param="key") from None
    if result == NOT_ADMIN:
        raise ApiError(404, "no such admin key", param="key", code="admin_key_not_found")
    if result == OWN_KEY:
        raise ApiError(409, "an admin key cannot revoke itself; revoke it with another admin key",
                       param="key", code="own_admin_key")
    if result == LAST_ADMIN:
        raise ApiError(409, "this is the last admin key; configure another before revoking it",
                       param="key", code="last_admin_key")
    return {"object": "admin_key", "revoked": True}
