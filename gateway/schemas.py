"""OpenAI request bodies (pydantic, strict); the response bodies are gateway/http/bodies.py's.

Request models check types and absurd sizes only; what a value means (ranges, the model, the
context) is checked by `GenerationService`, the one place shared with gRPC, except what only REST
has (`n`: gateway/http/choices.py; the logprobs bounds of each API's shape, here). Models are strict:
`"max_tokens": "5"` or `true` is a type error, not a coercion. Unknown fields are ignored, as
OpenAI does; OpenAI fields specgate does not implement are accepted at their neutral value only
(a request that relies on them fails loudly instead of being silently served differently).
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationInfo,
                      field_validator)

from gateway import errors, tool_calls
from gateway.service import MAX_STOP_CHARS, MAX_STOPS, GenerateInput
from gateway.tenancy.records import Tenant
from gateway.tiers import REQUEST_TIERS
from workers.contract import MAX_TOP_LOGPROBS

MAX_COMPLETION_LOGPROBS = 5   # the legacy completions API's bound on `logprobs`
BIG = 2**31 - 1              # upper bound for counts: refuses absurd numbers with the field named

_CONFIG = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

Count = Annotated[int, Field(ge=-BIG, le=BIG)]
ServiceTier = Literal[REQUEST_TIERS]     # "auto" and the tiers (gateway/tiers.py)


class StreamOptions(BaseModel):
    model_config = _CONFIG
    include_usage: bool = False


class ChatStreamOptions(StreamOptions):
    """specgate extension: `resumable: true` keeps a chat stream's request running when its
    client disconnects (it finishes, and a restarted gateway finishes it), so the client can
    resume it (GET /v1/chat/completions/{id}/stream, gateway/http/chat_stream.py)."""
    resumable: bool = False


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
    # applied at every tree node from its own path, so speculation stays lossless under them
    # (workers/speculation/processors.py); ranges checked by the service
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: Annotated[dict[str, Any], Field(max_length=4096)] | None = None
    # OpenAI's: the tier to run in (gateway/tiers.py); auto or none: the tenant's default
    service_tier: ServiceTier | None = None

    def generate_input(self, tenant: Tenant, **text: Any) -> GenerateInput:
        spec = self.speculation or SpeculationOptions()
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return GenerateInput(
            tenant=tenant, model=self.model, max_tokens=self._max_tokens(),
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            seed=self.seed, stop=stop, speculation=spec.enabled,
            max_tree_tokens=spec.max_tree_tokens, user=self.user,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=self.logit_bias, logprobs=self._logprobs(),
            service_tier=tenant.tier_for(self.service_tier), **text)

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _logprobs(self) -> int | None:
        """How many top alternatives to report per token; None: no logprobs."""
        return None

    @property
    def choices(self) -> int:
        return 1 if self.n is None else self.n

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
    def _logprobs_range(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_COMPLETION_LOGPROBS:
            raise ValueError(f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}]")
        return v

    def _logprobs(self) -> int | None:
        return self.logprobs

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


Name = Annotated[str, Field(max_length=256)]


def constraint_of(response_format: dict | None) -> str | None:
    """`SamplingParams.constraint` for OpenAI's response_format: None for text (or none given),
    else the JSON string workers/speculation/grammar.py compiles. Keys keep their order: a schema's property
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



class FunctionDef(BaseModel):
    model_config = _CONFIG
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Annotated[str, Field(max_length=65_536)] | None = None
    parameters: dict[str, Any] | None = None       # a JSON schema (object)
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = _CONFIG
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = _CONFIG
    name: Name


class NamedToolChoice(BaseModel):
    model_config = _CONFIG
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(BaseModel):
    model_config = _CONFIG
    name: Name
    arguments: str                                 # JSON text, as the model wrote it


class ToolCallIn(BaseModel):
    """A call of an earlier assistant turn, sent back in the conversation."""
    model_config = _CONFIG
    id: Name
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(BaseModel):
    """One turn. Fields are declared in the order their checks need: each check sees the fields
    before it (`info.data`), and a refusal names the field at fault (`messages.0.content`)."""
    model_config = _CONFIG
    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: Annotated[list[ToolCallIn], Field(min_length=1, max_length=128)] | None = None
    tool_call_id: Annotated[Name | None, Field(validate_default=True)] = None
    name: Name | None = None
    content: Annotated[str | Annotated[list[TextPart], Field(max_length=4096)] | None,
                       Field(validate_default=True)] = None

    @field_validator("tool_calls")
    @classmethod
    def _calls_on_assistant(cls, v: list | None, info: ValidationInfo) -> list | None:
        if v is not None and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return v

    @field_validator("tool_call_id")
    @classmethod
    def _answers_a_call(cls, v: str | None, info: ValidationInfo) -> str | None:
        role = info.data.get("role")
        if role == "tool" and v is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if role not in (None, "tool") and v is not None:
            raise ValueError("only tool messages carry a tool_call_id")
        return v

    @field_validator("content")
    @classmethod
    def _content(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError("content is required (it may be null only in an assistant message "
                             "with tool_calls)")
        return v

    def as_dict(self) -> dict[str, Any]:
        text = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        # NOTE: "developer" is OpenAI's newer name for "system"; chat templates know "system".
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": text}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    stream_options: ChatStreamOptions | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None
    top_logprobs: Count | None = None
    tools: Annotated[list[ToolDef], Field(min_length=1, max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_range(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        return v

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, v: list | None) -> list | None:
        if v:
            raise ValueError("the legacy 'functions' field is not supported: send 'tools'")
        return v

    @field_validator("response_format")
    @classmethod
    def _known_format(cls, v: dict | None) -> dict | None:
        constraint_of(v)                      # the shape here; the schema itself at the service
        return v

    @property
    def resumable(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.resumable)

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_input(self, tenant: Tenant) -> GenerateInput:
        if self.top_logprobs is not None and not self.logprobs:
            raise errors.invalid("top_logprobs needs logprobs: true", "top_logprobs")
        return self.generate_input(
            tenant, messages=[m.as_dict() for m in self.messages], tools=self._tools(),
            tool_choice=self._tool_choice(), parallel_tool_calls=self.parallel_tool_calls,
            constraint=constraint_of(self.response_format))

    def tool_parser(self) -> tool_calls.ToolStreamParser | None:
        """What reads the output for calls (gateway/tool_calls.py), or None: plain content."""
        mode = tool_calls.call_mode(self._tools(), self._tool_choice())
        if mode is None:
            return None
        return tool_calls.ToolStreamParser(self._tools(), mode,
                                      parallel=self.parallel_tool_calls is not False)

    def _tools(self) -> tuple[dict, ...] | None:
        return None if self.tools is None else tuple(t.model_dump(exclude_none=True)
                                                     for t in self.tools)

    def _tool_choice(self) -> str | dict | None:
        choice = self.tool_choice
        return choice.model_dump() if isinstance(choice, BaseModel) else choice
