"""What goes in and out of the generation service: plain data, shared by REST, gRPC, the Ray
ingress (`gateway.ray_serve.remote`) and the service's own rooms."""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol

from gateway.tenancy.records import Tenant
from scheduler.request import Request, RequestStats
from scheduler.tiers import DEFAULT_TIER


@dataclass(frozen=True)
class GenerateInput:
    tenant: Tenant | None               # None: not authenticated (refused with 401)
    model: str
    prompt: str | None = None           # completions
    messages: list[dict] | None = None  # chat (chat template applied)
    max_tokens: int | None = None       # None: up to the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    speculation: bool | None = None     # per-request switch (None: tenant default)
    max_tree_tokens: int | None = None  # per-request cap, bounded by the tenant's
    user: str | None = None
    prompt_ids: tuple[int, ...] | None = None   # completions given token ids instead of text
    tools: tuple[dict, ...] | None = None       # chat: OpenAI function tools (gateway/tool_calls.py)
    tool_choice: str | dict | None = None       # "none", "auto", "required" or a named function
    parallel_tool_calls: bool | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Any = None              # {"token id": bias}, as OpenAI takes it; None: none
    logprobs: int | None = None         # None: off; k: each token's logprob and its top k
    constraint: str | None = None       # SamplingParams.constraint (chat's response_format)
    request_id: str | None = None       # the id to give it (a response's id); None: a new one
    # runs whether or not anyone listens (a background response, `open_detached`): closing its
    # stream does not cancel it, and a restarted gateway finishes it instead of cancelling it
    detached: bool = False
    # kept with the request's record (`Request.meta`) for whoever reads it back: e.g. what a
    # chat stream's resume needs to render its chunks as the live stream did (gateway/replay.py)
    meta: dict | None = None
    # the service tier it asks for (gateway/tiers.py): a tier, "auto" or None (the tenant's
    # default); one its tenant may not use is refused (403)
    service_tier: str | None = None


@dataclass(frozen=True)
class SpecStats:
    drafted: int        # draft tokens verified (tree nodes), rejected ones included
    accepted: int       # draft tokens the target agreed with
    steps: int          # verification steps the request was in
    tau: float          # mean tokens committed per step (accepted + 1)

    @classmethod
    def of(cls, s: RequestStats) -> "SpecStats":
        """A request's speculation, from its final stats."""
        return cls(drafted=max(0, s.attained - s.n_steps), accepted=s.accepted_sum,
                   steps=s.n_steps, tau=(s.tau_sum / s.n_steps) if s.n_steps else 0.0)


@dataclass(frozen=True)
class TokenLogprobs:
    """One output token as a client's logprobs show it (rendered here, where the tokenizer is)."""
    token: str                      # its text, decoded alone
    bytes: tuple[int, ...]          # its bytes (gateway/text.py `token_piece`)
    logprob: float
    top: tuple[tuple[str, tuple[int, ...], float], ...]   # (token, bytes, logprob), likeliest first
    offset: int                     # where its text starts in the output text (characters)


@dataclass(frozen=True)
class StreamChunk:
    text: str                       # new text, safe to show (no stop string, no half character)
    token_ids: tuple[int, ...]      # tokens committed since the previous chunk
    # the logprobs of the tokens whose text this chunk completes (when asked for): a token's
    # entry goes out with the chunk that shows where its text starts
    logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True)
class GenerateOutput:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    speculation: SpecStats
    logprobs: tuple[TokenLogprobs, ...] | None = None   # of the tokens whose text is in `text`
    service_tier: str = DEFAULT_TIER    # the tier it ran in, as the response says it


class EventStream(Protocol):
    """What `open_stream` returns: `RequestStream` here, `gateway.ray_serve.remote.RemoteStream`
    in a Ray ingress; `StreamChunk`s, then one `GenerateOutput`."""
    request_id: str
    service_tier: str      # the tier it runs in: admission may have moved it (to flex)

    def __aiter__(self) -> AsyncIterator[StreamChunk | GenerateOutput]: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class Prepared:
    """A request that passed every check and is ready to submit."""
    request: Request
    tenant: Tenant
    model: str
    stops: tuple[str, ...]
    # its TTFT as admission predicted it (scheduler/miss.py), from admission; None: not predicted
    predicted_ttft_s: float | None = None


def new_request_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"
