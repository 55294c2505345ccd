"""POST /v1/responses' body (pydantic, strict, as gateway/schemas.py's models are).

Supported: `input` (a string, or message items whose content is text), `instructions`,
`max_output_tokens`, `temperature`, `top_p`, `seed`, `service_tier` and specgate's `speculation`,
`stream`, `background`, `store`, `metadata`, `previous_response_id`. OpenAI fields specgate does not
implement (tools, reasoning, structured `text.format`, includes, conversations, prompts, …) are
refused with a 400 naming the field when given a value that would change the output, as chat
completions does; unknown fields are ignored.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.schemas import Count, ServiceTier, SpeculationOptions

_CONFIG = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")
MAX_METADATA = 16                       # OpenAI's bounds on metadata
Text = Annotated[str, Field(max_length=4_000_000)]


class InputText(BaseModel):
    model_config = _CONFIG
    type: Literal["input_text", "output_text", "text"]
    text: Text


class InputMessage(BaseModel):
    model_config = _CONFIG
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | Annotated[list[InputText], Field(min_length=1, max_length=4096)]

    def as_dict(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        # "developer" is OpenAI's newer name for "system"; chat templates know "system"
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class TextFormat(BaseModel):
    model_config = _CONFIG
    type: Literal["text"]


class TextConfig(BaseModel):
    model_config = _CONFIG
    format: TextFormat | None = None


class ResponseRequest(BaseModel):
    model_config = _CONFIG
    model: Annotated[str, Field(max_length=512)]
    input: Text | Annotated[list[InputMessage], Field(min_length=1, max_length=4096)]
    instructions: Text | None = None
    max_output_tokens: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None
    speculation: SpeculationOptions | None = None
    stream: bool | None = False
    background: bool | None = False
    store: bool | None = True
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = None
    previous_response_id: Annotated[str, Field(max_length=128)] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    service_tier: ServiceTier | None = None     # auto or none: the tenant's default
    # accepted at their neutral values only
    text: TextConfig | None = None
    tools: Annotated[list[Any], Field(max_length=0)] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["disabled"] | None = None
    include: Annotated[list[Any], Field(max_length=0)] | None = None
    reasoning: None = None
    conversation: None = None
    prompt: None = None
    top_logprobs: Literal[0] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _message_items(cls, v: Any) -> Any:
        if isinstance(v, list):
            for i, item in enumerate(v):
                kind = item.get("type", "message") if isinstance(item, dict) else None
                if kind != "message":
                    raise ValueError(f"input.{i}: only message items (with text content) are "
                                     f"supported, got {kind!r}")
        return v

    @field_validator("metadata")
    @classmethod
    def _few_keys(cls, v: dict | None) -> dict | None:
        if v is not None and len(v) > MAX_METADATA:
            raise ValueError(f"metadata takes at most {MAX_METADATA} keys")
        return v

    @property
    def messages(self) -> list[dict[str, str]]:
        """This request's input as chat messages (instructions not included)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return [m.as_dict() for m in self.input]
