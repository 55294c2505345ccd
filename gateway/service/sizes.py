"""The one measure of a request, taken before any work on it, and the one check of it against
the caps: a prompt too long for the context or for the tenant is refused before it is templated
or tokenized, and a schema too large before it is compiled.

`measure` counts characters, templating, tokenizing and compiling nothing: the prompt or the
messages' contents (tool results included), the calls of earlier assistant turns (names and
arguments), the tool definitions the template will write (names, descriptions, and parameter
schemas as their compact JSON), a prompt given as token ids (how many), and the schema the output
must follow (response_format's, or a forced tool call's: the called functions' parameter schemas).
Every part that reaches the prompt is counted as prompt text, so one budget bounds them together:
with at most `max_token_chars` characters per token (gateway/text.py), n characters are at least
n / max_token_chars tokens however the template lays them out, and a prompt that cannot fit is
refused here, naming as its `param` the part that weighs most. Token ids are counted exactly,
before any is validated.

Stop strings and `logit_bias` have fixed caps of their own (gateway/service/fields.py: a few
thousand characters, a few hundred entries), checked before anything is templated too.

Pure: a function of the request and the caps. It runs where admission runs, on a worker thread
(gateway/service/core.py): the JSON of a tool's parameter schema is measured in proportion to it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway import errors, tool_calls
from gateway.service.types import GenerateInput

# the largest schema an output may be held to (response_format, or a forced call's parameters),
# in characters of its JSON, unless told otherwise (`schema_max_bytes`, gateway/settings.py, the
# same cap the grammar's own checks use): compiling one is the grammar engine's work, bounded
# before it starts
MAX_SCHEMA_CHARS = 131_072


@dataclass(frozen=True)
class RequestSize:
    """Characters of each part of a request that costs work to prepare (zero where absent)."""
    field: str = "prompt"       # where the prompt text is: "prompt" or "messages"
    text: int = 0               # the prompt, or the messages' contents (tool results included)
    tool_calls: int = 0         # earlier assistant turns' calls: names and arguments
    tools: int = 0              # tool definitions the template writes (none with tool_choice "none")
    token_ids: int | None = None    # a prompt given as ids: how many
    schema: int = 0             # the JSON schema the output follows
    schema_param: str = "response_format"   # where that schema came from ("tools" when forced)

    @property
    def prompt_chars(self) -> int:
        """Characters the prompt will hold at least, before the template adds its own."""
        return self.text + self.tool_calls + self.tools

    @property
    def heaviest(self) -> str:
        """The `param` a refusal of the whole prompt names: the part that weighs most."""
        parts = {self.field: self.text + self.tool_calls, "tools": self.tools}
        return max(parts, key=lambda p: parts[p])


def measure(inp: GenerateInput) -> RequestSize:
    """`inp` measured (module docstring). A malformed input measures as what it holds: the checks
    that follow name what is wrong with it."""
    schema, schema_param = _schema_chars(inp)
    if inp.prompt_ids is not None:
        count = len(inp.prompt_ids) if isinstance(inp.prompt_ids, (tuple, list)) else 0
        return RequestSize(token_ids=count, schema=schema, schema_param=schema_param)
    if isinstance(inp.prompt, str):
        return RequestSize("prompt", len(inp.prompt), schema=schema, schema_param=schema_param)
    messages = inp.messages if isinstance(inp.messages, list) else []
    shown = inp.tools if tool_calls.call_mode(inp.tools, inp.tool_choice) is not None else ()
    return RequestSize("messages", sum(_content_chars(m) for m in messages),
                       sum(_calls_chars(m) for m in messages),
                       sum(_tool_chars(t) for t in shown or ()),
                       schema=schema, schema_param=schema_param)


def check(size: RequestSize, *, context: int, max_token_chars: int,
          max_prompt_tokens: int | None, max_schema_chars: int = MAX_SCHEMA_CHARS) -> None:
    """Refuse (ApiError 413) a request whose measure cannot fit: a prompt of more tokens than the
    context holds (`context_length_exceeded`) or than the tenant may send
    (`max_prompt_tokens_exceeded`), token ids counted exactly and text at its fewest tokens; a
    schema over `max_schema_chars` (`schema_too_large`)."""
    if size.schema > max_schema_chars:
        raise errors.too_large(f"the output's JSON schema has {size.schema} characters; at most "
                               f"{max_schema_chars} are taken (schema_max_bytes)", size.schema_param,
                               code="schema_too_large")
    if size.token_ids is not None:
        check_tokens(size.token_ids, f"{size.token_ids} tokens", size.field,
                     context=context, max_prompt_tokens=max_prompt_tokens)
    else:
        fewest = -(-size.prompt_chars // max_token_chars)          # ceil
        check_tokens(fewest, f"at least {fewest} tokens{_breakdown(size)}", size.heaviest,
                     context=context, max_prompt_tokens=max_prompt_tokens)


def check_tokens(tokens: int, what: str, param: str, *, context: int,
                 max_prompt_tokens: int | None) -> None:
    """413 for a prompt of `tokens` tokens (described as `what`) that the context or the tenant's
    `max_prompt_tokens` cannot take: the one wording of both refusals, before tokenizing (a
    count or a lower bound) and after (the exact count)."""
    if tokens >= context:
        raise errors.too_large(f"the prompt has {what}; this model's context is {context} tokens "
                               f"(prompt and output together)", param,
                               code="context_length_exceeded")
    if max_prompt_tokens is not None and tokens > max_prompt_tokens:
        raise errors.too_large(f"the prompt has {what}; this API key may send at most "
                               f"{max_prompt_tokens}", param, code="max_prompt_tokens_exceeded")


def _breakdown(size: RequestSize) -> str:
    """Where the characters are, when more than the prompt's own text holds them."""
    if not size.tools and not size.tool_calls:
        return ""
    parts = [f"{size.text} characters of text"]
    if size.tool_calls:
        parts.append(f"{size.tool_calls} of tool calls")
    if size.tools:
        parts.append(f"{size.tools} of tool definitions")
    return " (" + ", ".join(parts) + ")"


def _content_chars(message: Any) -> int:
    content = message.get("content") if isinstance(message, dict) else None
    return len(content) if isinstance(content, str) else 0


def _calls_chars(message: Any) -> int:
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not isinstance(calls, (list, tuple)):
        return 0
    return sum(_str_len(f.get("name")) + _str_len(f.get("arguments"))
               for f in (c.get("function") if isinstance(c, dict) else None for c in calls)
               if isinstance(f, dict))


def _tool_chars(tool: Any) -> int:
    """A tool definition's name, description and parameter schema (as JSON)."""
    f = _function(tool)
    return _str_len(f.get("name")) + _str_len(f.get("description")) + json_chars(f.get("parameters"))


def _schema_chars(inp: GenerateInput) -> tuple[int, str]:
    """(characters, param) of the schema the output must follow: a forced call's (the called
    functions' parameter schemas) or response_format's (its JSON as the request carries it)."""
    if tool_calls.call_mode(inp.tools, inp.tool_choice) == "forced":
        named = _function(inp.tool_choice).get("name")
        chosen = [f for f in map(_function, inp.tools or ()) if named is None or f.get("name") == named]
        return sum(json_chars(f.get("parameters")) for f in chosen), "tools"
    return (len(inp.constraint) if isinstance(inp.constraint, str) else 0), "response_format"


def _function(holder: Any) -> dict:
    """The `function` object of a tool or of a named tool_choice ({} when there is none)."""
    f = holder.get("function") if isinstance(holder, dict) else None
    return f if isinstance(f, dict) else {}


def json_chars(value: Any) -> int:
    """Characters of `value` as compact JSON (0 for None). One C-speed pass: a schema sent as
    JSON dumps back at the size it arrived (its depth already passed the body's parser); a
    value too deep to dump is refused as the body's parser refuses one."""
    if value is None:
        return 0
    try:
        return len(json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str))
    except RecursionError:
        raise errors.invalid("a tool's parameters are nested too deeply", "tools") from None


def _str_len(v: Any) -> int:
    return len(v) if isinstance(v, str) else 0

