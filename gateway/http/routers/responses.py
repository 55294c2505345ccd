"""The Responses API: POST /v1/responses, GET /v1/responses/{id} (with `stream=true&
starting_after=N`: its events after N, then live ones), POST /v1/responses/{id}/cancel, DELETE
/v1/responses/{id}. The work is gateway/responses/service.py's; this file is HTTP only. A GET is
a request of its tenant's: charged to its rpm, and streamed, holding a follower slot while it
streams (gateway/followers.py)."""
from __future__ import annotations

import json
import logging
from typing import Annotated, Any, AsyncIterator

from fastapi import APIRouter, Depends, Request

from gateway import errors
from gateway.errors import ApiError
from gateway.http.deps import (ArrivedTenantDep, SettingsDep, TenantDep, json_body, sse_response,
                               until_disconnected)
from gateway.http.followers import ResponseReaderDep
from gateway.responses.request import ResponseRequest
from gateway.responses.service import ResponseService

log = logging.getLogger(__name__)
router = APIRouter(tags=["responses"])

Body = Annotated[ResponseRequest, Depends(json_body(ResponseRequest))]
_OPENAPI = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": ResponseRequest.model_json_schema(ref_template="#/components/schemas/{model}")}}}}


async def get_responses(request: Request) -> ResponseService:
    service = request.app.state.responses
    if service is None:
        raise ApiError(404, "this deployment does not serve the Responses API", code="not_found")
    return service


ResponsesDep = Annotated[ResponseService, Depends(get_responses)]


def _sse(events: AsyncIterator[dict], keepalive_s: float) -> Any:
    async def lines() -> AsyncIterator[str]:
        try:
            async for ev in events:
                data = json.dumps(ev, ensure_ascii=False, separators=(",", ":"))
                yield f"event: {ev['type']}\ndata: {data}\n\n"
        except ApiError as e:                           # once the 200 is out: an error event
            yield _error_event(e)
        except Exception:
            log.exception("a response stream failed")
            yield _error_event(ApiError(500, "internal server error", code="internal_error"))
        finally:
            await events.aclose()
    return sse_response(lines(), keepalive_s)


def _error_event(e: ApiError) -> str:
    body = {"type": "error", "code": e.code, "message": e.message, "param": e.param,
            "sequence_number": -1}
    return f"event: error\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"


@router.post("/v1/responses", openapi_extra=_OPENAPI)
async def create_response(request: Request, tenant: ArrivedTenantDep, responses: ResponsesDep,
                          settings: SettingsDep, body: Body) -> Any:
    if body.stream:
        return _sse(await responses.create(tenant, body), settings.stream_keepalive_s)
    if body.background:
        return await responses.create(tenant, body)
    return await until_disconnected(request, responses.create(tenant, body))


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, tenant: TenantDep, _: ResponseReaderDep,
                       responses: ResponsesDep, settings: SettingsDep, stream: bool = False,
                       starting_after: int | None = None) -> Any:
    if starting_after is not None and not stream:
        raise errors.invalid("starting_after needs stream=true", "starting_after")
    if starting_after is not None and starting_after < -1:
        raise errors.invalid("starting_after must be >= -1", "starting_after")
    got = await responses.retrieve(tenant, response_id, stream=stream, starting_after=starting_after)
    return _sse(got, settings.stream_keepalive_s) if stream else got


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, tenant: TenantDep, responses: ResponsesDep) -> Any:
    return await responses.cancel(tenant, response_id)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, tenant: TenantDep, responses: ResponsesDep) -> Any:
    return await responses.delete(tenant, response_id)
