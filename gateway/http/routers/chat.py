"""POST /v1/chat/completions: messages in (through the model's chat template), an assistant
message out, streamed as `chat.completion.chunk` deltas or not. With tools, the output is read
for calls (gateway/tools.py): `message.tool_calls`, streamed as tool-call deltas."""
from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from gateway import schemas
from gateway.http.deps import (ServiceDep, TenantDep, json_body, sse_events, sse_response,
                          until_disconnected)
from gateway.schemas import ChatRequest

router = APIRouter(tags=["chat"])

Body = Annotated[ChatRequest, Depends(json_body(ChatRequest))]
_OPENAPI = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": ChatRequest.model_json_schema(ref_template="#/components/schemas/{model}")}}}}


@router.post("/v1/chat/completions", openapi_extra=_OPENAPI)
async def create_chat_completion(request: Request, tenant: TenantDep, service: ServiceDep,
                                 body: Body) -> Any:
    inp = body.to_input(tenant)
    created = schemas.now_s()
    parser = body.tool_parser()
    if not body.stream:
        out = await until_disconnected(request, service.generate(inp))
        return schemas.chat_body(out, body.model, created, parser)
    stream = await service.open_stream(inp)
    rid, model = stream.request_id, body.model
    extra = {"usage": None} if body.include_usage else {}

    def event(delta: dict, finish_reason: str | None = None) -> dict:
        return {**schemas.chat_chunk(rid, model, created, delta, finish_reason), **extra}

    def chunk(text: str) -> list[dict]:
        deltas = [{"content": text}] if parser is None else parser.push(text)
        return [event(d) for d in deltas]

    def final(out) -> list[dict]:
        held = [] if parser is None else [event(d) for d in parser.finish()]
        return held + [{**event({}, schemas.finish_reason(out.finish_reason, parser)),
                        "specgate": schemas.spec_stats(out.speculation)}]

    def usage(out) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [], "usage": schemas.usage(out)}

    opening = event({"role": "assistant", "content": ""})
    return sse_response(sse_events(stream, chunk=chunk, final=final, opening=opening,
                                   usage=usage if body.include_usage else None))
