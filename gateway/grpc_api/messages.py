"""What crosses the gRPC front, converted: a request message into the service's input, by REST's
rules and in REST's order (the API key from metadata, the tenant's requests per minute charged,
then REST's request models, `gateway.schemas`, so sizes, defaults and error messages match), and
the service's output and events into messages. Used by the embedded server
(gateway/grpc_api/server.py) and by Ray mode's ingress (gateway/ray_serve/ingress.py) alike.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncGenerator, AsyncIterator, Callable, Protocol

import pydantic

from gateway import errors, schemas
from gateway.errors import ApiError
from gateway.grpc_api.proto import specgate_pb2 as pb
from gateway.http.parse import field_names
from gateway.keepalive import with_keepalive
from gateway.service import EventStream, GenerateInput, GenerateOutput
from gateway.tenancy.records import Tenant
from gateway.tenancy.tenants import TenantRegistry

# what a waiting stream sends as its keep-alive: a delta of no text and no tokens
KEEPALIVE_MESSAGE = pb.GenerateStreamResponse(delta=pb.GenerateDelta())
_FIELDS = {m: field_names(m) for m in (schemas.CompletionRequest, schemas.ChatRequest)}


async def authed_tenant(tenants: TenantRegistry, metadata: Any) -> Tenant:
    """The caller's tenant (401 without a known key), off the event loop when tenants live in
    Redis."""
    if tenants.remote:
        tenant = await asyncio.to_thread(tenants.authenticate, api_key(metadata))
    else:
        tenant = tenants.authenticate(api_key(metadata))
    if tenant is None:
        raise errors.unauthorized()
    return tenant


class Arrivals(Protocol):
    """What `arrived_input` charges an arriving request to: `GenerationService`, or Ray mode's
    `RemoteService` (the ingress's own limiter)."""
    async def arrive(self, tenant: Tenant) -> None: ...


async def arrived_input(service: Arrivals, tenants: TenantRegistry, request: pb.GenerateRequest,
                        metadata: Any, max_bytes: int | None,
                        seen: Callable[[Tenant], None] | None = None) -> GenerateInput:
    """A request as it arrives, in REST's order: its size against the body cap (413, before
    anything: in Ray mode Serve's proxy takes messages up to its own cap, so this is ours), the
    caller's tenant (401; handed to `seen`, so that a refusal from here on can be noted for
    the key: gateway/grpc_api/early.py), the request charged to the tenant's requests per
    minute (429; from here on every refusal has cost the tenant a request), then REST's
    validation, off the event loop (its work grows with the message)."""
    if max_bytes is not None and request.ByteSize() > max_bytes:
        raise errors.too_large(f"the request message is larger than {max_bytes} bytes")
    tenant = await authed_tenant(tenants, metadata)
    if seen is not None:
        seen(tenant)
    await service.arrive(tenant)
    return await asyncio.to_thread(generate_input, request, tenant)


async def stream_messages(stream: EventStream) -> AsyncIterator[pb.GenerateStreamResponse]:
    """A service stream's events as GenerateStream messages: deltas, then the final response (and,
    as REST does, an error after the final of a request the engine failed)."""
    async for item in stream:
        if isinstance(item, GenerateOutput):
            yield pb.GenerateStreamResponse(final=response_message(item))
            if item.finish_reason == "error":
                raise generation_failed()
        else:
            yield pb.GenerateStreamResponse(delta=pb.GenerateDelta(text=item.text, token_ids=item.token_ids))


def kept_alive(messages: AsyncGenerator[pb.GenerateStreamResponse, None],
               keepalive_s: float) -> AsyncGenerator[pb.GenerateStreamResponse, None]:
    """`messages`, and `KEEPALIVE_MESSAGE` each time `keepalive_s` seconds pass without one."""
    return with_keepalive(messages, keepalive_s, KEEPALIVE_MESSAGE)


def api_key(metadata: Any) -> str | None:
    """The key from `authorization: Bearer <key>`, else from `x-api-key: <key>`."""
    pairs = {k.lower(): v for k, v in (metadata or ()) if isinstance(v, str)}
    scheme, _, key = pairs.get("authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return key.strip()
    return pairs.get("x-api-key", "").strip() or None


def generate_input(request: pb.GenerateRequest, tenant: Tenant) -> GenerateInput:
    """Proto → the REST body it stands for → REST's request model → `GenerateInput`: the same
    size limits, defaults and validation errors as /v1/completions and /v1/chat/completions.
    Fields left unset are left out, so REST's defaults apply."""
    body: dict[str, Any] = {"model": request.model}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        if request.HasField(name):
            body[name] = getattr(request, name)
    if request.stop:
        body["stop"] = list(request.stop)
    if request.user:
        body["user"] = request.user
    if request.service_tier:
        body["service_tier"] = request.service_tier
    speculation = {rest: getattr(request, name) for rest, name in
                   (("enabled", "speculation"), ("max_tree_tokens", "max_tree_tokens"))
                   if request.HasField(name)}
    if speculation:
        body["speculation"] = speculation
    which = request.WhichOneof("input")
    model: type[schemas.CompletionRequest] | type[schemas.ChatRequest] = schemas.CompletionRequest
    if which == "prompt":
        body["prompt"] = request.prompt
    elif which == "prompt_ids":
        body["prompt"] = list(request.prompt_ids.ids)
    elif which == "messages":
        model = schemas.ChatRequest
        if any(m.role == "tool" for m in request.messages.messages):
            # NOTE: the proto carries no tools, tool calls nor tool_call_id (yet): refused by
            # name rather than as a malformed message
            raise errors.invalid("tool calling is not available over gRPC; use POST "
                                 "/v1/chat/completions", "messages", code="unsupported_parameter")
        body["messages"] = [{"role": m.role, "content": m.content} for m in request.messages.messages]
    else:
        raise ApiError(400, "send one of 'prompt', 'messages' or 'prompt_ids'", param="prompt",
                       code="missing_required_parameter")
    try:
        return model.model_validate(body).to_input(tenant)
    except pydantic.ValidationError as exc:
        raise errors.from_validation_errors(exc.errors(include_url=False), _FIELDS[model]) from None


def response_message(out: GenerateOutput) -> pb.GenerateResponse:
    s = out.speculation
    return pb.GenerateResponse(
        id=out.request_id, text=out.text, token_ids=out.token_ids, finish_reason=out.finish_reason,
        usage=pb.Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                       total_tokens=out.prompt_tokens + out.completion_tokens),
        speculation=pb.SpeculationStats(drafted=s.drafted, accepted=s.accepted, steps=s.steps, tau=s.tau),
        service_tier=out.service_tier)


def generation_failed() -> ApiError:
    """What `GenerationService.generate` raises for a request the engine failed."""
    return ApiError(500, "generation failed; retry the request", code="generation_failed")
