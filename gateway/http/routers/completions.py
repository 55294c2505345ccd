"""POST /v1/completions: text in, text out (OpenAI's legacy completions API), streamed or not."""
from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from gateway.http import bodies
from gateway.http.choices import check_choices, generate_choices, open_choices
from gateway.http.deps import (ArrivedTenantDep, ServiceDep, SettingsDep, json_body, sse_events,
                               sse_response, until_disconnected)
from gateway.schemas import CompletionRequest

router = APIRouter(tags=["completions"])

Body = Annotated[CompletionRequest, Depends(json_body(CompletionRequest))]
_OPENAPI = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": CompletionRequest.model_json_schema(ref_template="#/components/schemas/{model}")}}}}


@router.post("/v1/completions", openapi_extra=_OPENAPI)
async def create_completion(request: Request, tenant: ArrivedTenantDep, service: ServiceDep,
                            settings: SettingsDep, body: Body) -> Any:
    inp = body.to_input(tenant)
    n = body.choices
    check_choices(n, settings.max_choices)
    created = bodies.now_s()
    if not body.stream:
        outs = await until_disconnected(request, generate_choices(service, inp, n))
        return bodies.completion_body(outs, body.model, created)
    streams = await open_choices(service, inp, n)
    rid, model, tier = streams[0].request_id, body.model, streams[0].service_tier
    extra = {"usage": None} if body.include_usage else {}

    def chunk(i: int, piece) -> dict:
        return {**bodies.completion_chunk(rid, model, created, piece.text, index=i,
                                           service_tier=tier, logprobs=piece.logprobs), **extra}

    def final(i: int, out) -> dict:
        return {**bodies.completion_chunk(rid, model, created, "", out.finish_reason, index=i,
                                           service_tier=tier),
                **extra, "specgate": bodies.spec_stats([out])}

    def usage(outs) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "service_tier": tier, "choices": [], "usage": bodies.usage(outs)}

    return sse_response(sse_events(streams, chunk=chunk, final=final,
                                   usage=usage if body.include_usage else None),
                        settings.stream_keepalive_s)
