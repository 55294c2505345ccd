"""POST /v1/chat/completions: messages in (through the model's chat template), an assistant
message out, streamed as `chat.completion.chunk` deltas or not. With tools, the output is read
for calls (gateway/tools.py): `message.tool_calls`, streamed as tool-call deltas."""
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
    parsers = [body.tool_parser() for _ in range(n)]     # each choice's output read for calls
    if not body.stream:
        outs = await until_disconnected(request, generate_choices(service, inp, n))
        return schemas.chat_body(outs, body.model, created, parsers)
    streams = await open_choices(service, inp, n)
    rid, model = streams[0].request_id, body.model
    extra = {"usage": None} if body.include_usage else {}

    def event(i: int, delta: dict, finish_reason: str | None = None, logprobs=None) -> dict:
        return {**schemas.chat_chunk(rid, model, created, delta, finish_reason, index=i,
                                     logprobs=logprobs), **extra}

    def chunk(i: int, piece) -> list[dict]:
        parser = parsers[i]
        deltas = [{"content": piece.text}] if parser is None else parser.push(piece.text)
        if not deltas and piece.logprobs:     # text held by the tool parser: its logprobs go now
            deltas = [{}]
        return [event(i, d, logprobs=piece.logprobs if k == 0 else None) for k, d in enumerate(deltas)]

    def final(i: int, out) -> list[dict]:
        parser = parsers[i]
        held = [] if parser is None else [event(i, d) for d in parser.finish()]
        return held + [{**event(i, {}, schemas.finish_reason(out.finish_reason, parser)),
                        "specgate": schemas.spec_stats([out])}]

    def usage(outs) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [], "usage": schemas.usage(outs)}

    openings = [event(i, {"role": "assistant", "content": ""}) for i in range(n)]
    return sse_response(sse_events(streams, chunk=chunk, final=final, openings=openings,
                                   usage=usage if body.include_usage else None))
