"""OpenAI request bodies (pydantic, strict) and response bodies (plain dicts, built in one place).

Request models check types and absurd sizes only; what a value means (ranges, n = 1, the model,
the context) is checked by `GenerationService`, the one place shared with gRPC. Models are strict:
`"max_tokens": "5"` or `true` is a type error, not a coercion. Unknown fields are ignored, as
OpenAI does; OpenAI fields specgate does not implement are accepted at their neutral value only
(a request that relies on them fails loudly instead of being silently served differently).
"""
from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from gateway.service import MAX_STOP_CHARS, MAX_STOPS, GenerateInput, GenerateOutput, SpecStats
from gateway.tenancy.records import Tenant

BIG = 2**31 - 1              # upper bound for counts: refuses absurd numbers with the field named

_CONFIG = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

Count = Annotated[int, Field(ge=-BIG, le=BIG)]


class StreamOptions(BaseModel):
    model_config = _CONFIG
    include_usage: bool = False


class SpeculationOptions(BaseModel):
    """specgate extension: `{"enabled": false}` turns speculation off for this request;
    `{"max_tree_tokens": 8}` caps its token tree (both bounded by the tenant's policy)."""
    model_config = _CONFIG
    enabled: bool | None = None
    max_tree_tokens: Count | None = None


class _Sampling(BaseModel):
    model_config = _CONFIG
    model: Annotated[str, Field(max_length=512)]
    max_tokens: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Count | None = None                 # extension; 0 or -1: off
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None
    stop: Annotated[str, Field(max_length=MAX_STOP_CHARS)] | Annotated[
        list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOPS)] | None = None
    n: Count | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    speculation: SpeculationOptions | None = None
    # OpenAI fields not implemented: neutral values only.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError("only n = 1 is supported: send one request per choice")
        return v

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None) -> float | None:
        if v:
            raise ValueError("penalties are not supported (they would change the target's "
                             "distribution, which speculative decoding reproduces exactly)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    def generate_input(self, tenant: Tenant, **text: Any) -> GenerateInput:
        spec = self.speculation or SpeculationOptions()
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return GenerateInput(
            tenant=tenant, model=self.model, max_tokens=self._max_tokens(),
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            seed=self.seed, stop=stop, speculation=spec.enabled,
            max_tree_tokens=spec.max_tree_tokens, user=self.user, **text)

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    # A string, a list of one string, or a list of token ids.
    prompt: Union[Annotated[str, Field(max_length=4_000_000)],
                  Annotated[list[StrictStr], Field(min_length=1, max_length=1)],
                  Annotated[list[Annotated[StrictInt, Field(ge=0, le=BIG)]], Field(min_length=1)]]
    echo: bool | None = None
    logprobs: Count | None = None
    best_of: Count | None = None
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: int | None) -> int | None:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError("only best_of = 1 is supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix (insertion) is not supported")
        return v

    def to_input(self, tenant: Tenant) -> GenerateInput:
        p = self.prompt
        if isinstance(p, str):
            return self.generate_input(tenant, prompt=p)
        if isinstance(p[0], str):
            return self.generate_input(tenant, prompt=p[0])
        return self.generate_input(tenant, prompt_ids=tuple(p))


class TextPart(BaseModel):
    model_config = _CONFIG
    type: Literal["text"]
    text: str


def constraint_of(response_format: dict | None) -> str | None:
    """`SamplingParams.constraint` for OpenAI's response_format: None for text (or none given),
    else the JSON string workers/grammar.py compiles. Keys keep their order: a schema's property
    order is the order the output writes them in.

    >>> constraint_of({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}})
    '{"type": "json_schema", "schema": {"type": "object"}}'
    """
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "json_object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format json_schema needs a 'json_schema' object with a 'schema' object")
        # NOTE: strict or not, the output follows the schema strictly (no property it does not name)
        return json.dumps({"type": "json_schema", "schema": spec["schema"]})
    shown = repr(kind)[:40] if isinstance(kind, str) else f"a {type(kind).__name__}"
    raise ValueError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {shown}")


class ChatMessage(BaseModel):
    model_config = _CONFIG
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(max_length=4096)]
    name: Annotated[str, Field(max_length=256)] | None = None

    def as_dict(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        # NOTE: "developer" is OpenAI's newer name for "system"; chat templates know "system".
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None
    top_logprobs: Count | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, v: list | None) -> list | None:
        if v:
            raise ValueError("tool calling is not supported")
        return v

    @field_validator("response_format")
    @classmethod
    def _known_format(cls, v: dict | None) -> dict | None:
        constraint_of(v)                      # the shape here; the schema itself at the service
        return v

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_input(self, tenant: Tenant) -> GenerateInput:
        return self.generate_input(tenant, messages=[m.as_dict() for m in self.messages],
                                   constraint=constraint_of(self.response_format))


# ---- responses ---------------------------------------------------------------------------------------
def now_s() -> int:
    return int(time.time())


def usage(out: GenerateOutput) -> dict[str, int]:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens}


def spec_stats(s: SpecStats) -> dict[str, Any]:
    return {"drafted": s.drafted, "accepted": s.accepted, "steps": s.steps, "tau": round(s.tau, 4)}


def completion_body(out: GenerateOutput, model: str, created: int) -> dict[str, Any]:
    return {"id": out.request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": out.text, "logprobs": None,
                         "finish_reason": out.finish_reason}],
            "usage": usage(out), "specgate": spec_stats(out.speculation)}


def completion_chunk(rid: str, model: str, created: int, text: str,
                     finish_reason: str | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish_reason}]}


def chat_body(out: GenerateOutput, model: str, created: int) -> dict[str, Any]:
    return {"id": out.request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                         "logprobs": None, "finish_reason": out.finish_reason}],
            "usage": usage(out), "specgate": spec_stats(out.speculation)}


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, str],
               finish_reason: str | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": finish_reason}]}
