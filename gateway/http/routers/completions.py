"""POST /v1/completions: text in, text out (OpenAI's legacy completions API), streamed or not."""
from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from gateway import schemas
from gateway.http.deps import (ServiceDep, TenantDep, json_body, sse_events, sse_response,
                          until_disconnected)
from gateway.schemas import CompletionRequest

router = APIRouter(tags=["completions"])

Body = Annotated[CompletionRequest, Depends(json_body(CompletionRequest))]
_OPENAPI = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": CompletionRequest.model_json_schema(ref_template="#/components/schemas/{model}")}}}}


@router.post("/v1/completions", openapi_extra=_OPENAPI)
async def create_completion(request: Request, tenant: TenantDep, service: ServiceDep,
                            body: Body) -> Any:
    inp = body.to_input(tenant)
    created = schemas.now_s()
    if not body.stream:
        out = await until_disconnected(request, service.generate(inp))
        return schemas.completion_body(out, body.model, created)
    stream = await service.open_stream(inp)
    rid, model = stream.request_id, body.model
    extra = {"usage": None} if body.include_usage else {}

    def chunk(text: str) -> dict:
        return {**schemas.completion_chunk(rid, model, created, text), **extra}

    def final(out) -> dict:
        return {**schemas.completion_chunk(rid, model, created, "", out.finish_reason), **extra,
                "specgate": schemas.spec_stats(out.speculation)}

    def usage(out) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [], "usage": schemas.usage(out)}

    return sse_response(sse_events(stream, chunk=chunk, final=final,
                                   usage=usage if body.include_usage else None))
