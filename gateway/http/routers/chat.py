"""POST /v1/chat/completions: messages in (through the model's chat template), an assistant
message out, streamed as `chat.completion.chunk` deltas or not."""
from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from gateway import schemas
from gateway.http.choices import check_choices, generate_choices, open_choices
from gateway.http.deps import (ServiceDep, SettingsDep, TenantDep, json_body, sse_events,
                               sse_response, until_disconnected)
from gateway.schemas import ChatRequest

router = APIRouter(tags=["chat"])

Body = Annotated[ChatRequest, Depends(json_body(ChatRequest))]
_OPENAPI = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": ChatRequest.model_json_schema(ref_template="#/components/schemas/{model}")}}}}


@router.post("/v1/chat/completions", openapi_extra=_OPENAPI)
async def create_chat_completion(request: Request, tenant: TenantDep, service: ServiceDep,
                                 settings: SettingsDep, body: Body) -> Any:
    inp = body.to_input(tenant)
    n = body.choices
    check_choices(n, settings.max_choices)
    created = schemas.now_s()
    if not body.stream:
        outs = await until_disconnected(request, generate_choices(service, inp, n))
        return schemas.chat_body(outs, body.model, created)
    streams = await open_choices(service, inp, n)
    rid, model = streams[0].request_id, body.model
    extra = {"usage": None} if body.include_usage else {}

    def chunk(i: int, piece) -> dict:
        return {**schemas.chat_chunk(rid, model, created, {"content": piece.text}, index=i,
                                     logprobs=piece.logprobs), **extra}

    def final(i: int, out) -> dict:
        return {**schemas.chat_chunk(rid, model, created, {}, out.finish_reason, index=i), **extra,
                "specgate": schemas.spec_stats([out])}

    def usage(outs) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [], "usage": schemas.usage(outs)}

    openings = [{**schemas.chat_chunk(rid, model, created, {"role": "assistant", "content": ""},
                                      index=i), **extra} for i in range(n)]
    return sse_response(sse_events(streams, chunk=chunk, final=final, openings=openings,
                                   usage=usage if body.include_usage else None))
