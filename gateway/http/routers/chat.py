"""POST /v1/chat/completions: messages in (through the model's chat template), an assistant
message out, streamed as `chat.completion.chunk` deltas or not. With tools, the output is read
for calls (gateway/tool_calls.py): `message.tool_calls`, streamed as tool-call deltas.

GET /v1/chat/completions/{id}/stream (specgate extension): a stream resumed after the
`Last-Event-ID` its client sends (or `?after=`), read from the request's record
(gateway/replay.py); the ids, and which streams can be resumed: gateway/http/chat_stream.py.
A resume is a request of its tenant's: charged to its rpm, holding a follower slot while it
streams (gateway/followers.py)."""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request

from gateway import errors
from gateway.errors import ApiError
from gateway.http import bodies
from gateway.http.chat_stream import ChatChunks, ChatIds, ChatView, refusal, resume_from
from gateway.http.choices import check_choices, generate_choices, open_choices
from gateway.http.deps import (ArrivedTenantDep, ServiceDep, SettingsDep, TenantDep, json_body,
                               sse_events, sse_response, until_disconnected)
from gateway.http.followers import FollowerDep
from gateway.replay import Replayer, not_found
from gateway.schemas import ChatRequest

router = APIRouter(tags=["chat"])

Body = Annotated[ChatRequest, Depends(json_body(ChatRequest))]
_OPENAPI = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": ChatRequest.model_json_schema(ref_template="#/components/schemas/{model}")}}}}


async def get_replayer(request: Request) -> Replayer:
    replayer = request.app.state.replayer
    if replayer is None:
        raise ApiError(404, "this deployment does not resume streams", code="not_found")
    return replayer


ReplayerDep = Annotated[Replayer, Depends(get_replayer)]


@router.post("/v1/chat/completions", openapi_extra=_OPENAPI)
async def create_chat_completion(request: Request, tenant: ArrivedTenantDep, service: ServiceDep,
                                 settings: SettingsDep, body: Body) -> Any:
    inp = body.to_input(tenant)
    n = body.choices
    check_choices(n, settings.max_choices)
    created = bodies.now_s()
    parsers = [body.tool_parser() for _ in range(n)]     # each choice's output read for calls
    if not body.stream:
        outs = await until_disconnected(request, generate_choices(service, inp, n))
        return bodies.chat_body(outs, body.model, created, parsers)
    why = refusal(n, parsers[0] is not None, inp.logprobs is not None)
    if body.resumable and why is not None:
        raise errors.invalid(f"stream_options.resumable: {why}", "stream_options.resumable")
    view = ChatView(body.model, created, body.include_usage, why, inp.service_tier)
    # kept with the record for a resume; `detached`: a disconnect does not cancel it
    inp = dataclasses.replace(inp, meta=view.to_meta(), detached=body.resumable)
    streams = await open_choices(service, inp, n)
    # the tier it runs in: admission may have moved it to flex (gateway/service/admission.py)
    view = dataclasses.replace(view, service_tier=streams[0].service_tier)
    chunks = ChatChunks(view, streams[0].request_id, parsers)
    return sse_response(sse_events(streams, chunk=chunks.chunk, final=chunks.final,
                                   openings=chunks.openings(),
                                   usage=chunks.usage if view.usage else None,
                                   ids=ChatIds() if why is None else None),
                        settings.stream_keepalive_s)


@router.get("/v1/chat/completions/{request_id}/stream")
async def resume_chat_completion(request_id: str, tenant: TenantDep, _: FollowerDep,
                                 replayer: ReplayerDep, settings: SettingsDep,
                                 after: str | None = None,
                                 last_event_id: Annotated[str | None, Header()] = None) -> Any:
    # the header wins: an EventSource reconnecting sends the newest id, to the same URL
    resume = resume_from(last_event_id if last_event_id is not None else after)
    record = await replayer.open(tenant, request_id)
    view = ChatView.from_meta(record.meta)
    if view is None:
        raise not_found(request_id)              # not a chat completion stream
    if view.refusal is not None:
        raise errors.invalid(view.refusal, "request_id", code="stream_not_resumable")
    stream = replayer.stream(record, resume.cursor)
    chunks = ChatChunks(view, request_id, [None], skip_final=not resume.final)
    return sse_response(sse_events([stream], chunk=chunks.chunk, final=chunks.final,
                                   openings=chunks.openings() if resume.opening else (),
                                   usage=chunks.usage if view.usage and resume.usage else None,
                                   ids=ChatIds(resume.cursor.chars or 0)),
                        settings.stream_keepalive_s)
