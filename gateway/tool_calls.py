"""Tool calling on /v1/chat/completions: the request's tools checked, written into the prompt, the
constraint a forced call must follow, and calls read back out of the model's text. Pure: no HTTP,
no torch; the tokenizer is only asked to render its chat template.

How a call travels, in the fallback format (below) or a template's own:

    tools + messages ──render_chat──▶ prompt text        (the template's own rendering if it
                                                           renders tools, else the fallback)
    tool_choice ──forced_constraint──▶ SamplingParams.constraint   (required / a named function)
    model text ──parse_output / ToolStreamParser──▶ content + tool calls (+ streamed deltas)

The fallback format (Hermes / Qwen 2.5 style, what many small instruct models were tuned on): the
tool definitions go in the system message as JSON lines inside `<tools></tools>`; the model writes
each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; an earlier assistant turn's
calls are written back the same way, and `tool` messages become a user turn of
`<tool_response>...</tool_response>` blocks (chat templates that know no tools know no `tool`
role either). SmolLM2's template, the default model's, renders no tools: it uses this fallback.

NOTE: a forced call (`tool_choice` "required" or a named function) is *bare JSON*, one call,
`{"name": ..., "arguments": {...}}`: the engine's constraint is a JSON schema, which cannot
spell the `<tool_call>` tags around it. Its parser accepts the tagged form as well.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"

Mode = Literal["auto", "forced"]


class ToolError(ValueError):
    """A request whose tools or tool_choice cannot be served; `param` names the field (400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str              # a JSON object, as text (what OpenAI's `function.arguments` is)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---- the request ---------------------------------------------------------------------------------
def check_request(tools: Sequence[dict] | None, tool_choice: Any,
                  parallel_tool_calls: bool | None) -> None:
    """Raise `ToolError` for what OpenAI refuses and specgate used to ignore silently:
    `tool_choice` or `parallel_tool_calls` without `tools`, a named function not among them,
    two functions of one name."""
    if not tools:
        if tool_choice is not None:
            raise ToolError("tool_choice is only allowed when tools are given", "tool_choice")
        if parallel_tool_calls is not None:
            raise ToolError("parallel_tool_calls is only allowed when tools are given",
                            "parallel_tool_calls")
        return
    names = [t["function"]["name"] for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ToolError(f"two tools are named {name!r}; function names must be unique",
                            f"tools.{i}.function.name")
    named = _named(tool_choice)
    if named is not None and named not in names:
        raise ToolError(f"tool_choice names the function {named!r}, which is not in tools",
                        "tool_choice")


def call_mode(tools: Sequence[dict] | None, tool_choice: Any) -> Mode | None:
    """None: the output is plain content (no tools, or tool_choice "none"); "auto": the model may
    write tagged calls among its text; "forced": the output is one call as bare JSON."""
    if not tools or tool_choice == "none":
        return None
    if tool_choice == "required" or _named(tool_choice) is not None:
        return "forced"
    return "auto"


def _named(tool_choice: Any) -> str | None:
    if isinstance(tool_choice, dict):
        return tool_choice.get("function", {}).get("name")
    return None


# ---- the constraint a forced call follows ----------------------------------------------------------
def forced_schema(tools: Sequence[dict] | None, tool_choice: Any) -> dict | None:
    """The JSON schema of the whole output when a call is forced, else None.

    >>> t = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    >>> forced_schema(t, "required")["properties"]["name"]
    {'const': 'f'}
    """
    if call_mode(tools, tool_choice) != "forced":
        return None
    named = _named(tool_choice)
    chosen = [t["function"] for t in tools if named is None or t["function"]["name"] == named]
    alternatives = [_call_schema(f) for f in chosen]
    return alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}


def _call_schema(function: dict) -> dict:
    params = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object",
            "properties": {"name": {"const": function["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def forced_constraint(tools: Sequence[dict] | None, tool_choice: Any) -> str | None:
    """What `SamplingParams.constraint` carries for this request: the one place tools ask the
    engine to force its output (`{"type": "json_schema", "schema": ...}` as a JSON string), or
    None when nothing is forced."""
    schema = forced_schema(tools, tool_choice)
    if schema is None:
        return None
    return json.dumps({"type": "json_schema", "schema": schema}, sort_keys=True)


# ---- the prompt ---------------------------------------------------------------------------------------
def uses_tools(messages: Sequence[dict], tools: Sequence[dict] | None) -> bool:
    """Whether this conversation needs tool rendering (else the plain chat template serves)."""
    return bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def template_renders_tools(tokenizer: Any) -> bool:
    """Does the model's chat template write tool definitions into the prompt? Rendered once with
    a probe tool and once without: the same text means the template ignores `tools`."""
    probe = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "probe_fn", "description": "probe",
                                             "parameters": {"type": "object", "properties": {}}}}
    try:
        with_tools = tokenizer.apply_chat_template(probe, tools=[tool], add_generation_prompt=True,
                                                   tokenize=False)
        without = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    except Exception:                       # a template (or stand-in) that takes no tools
        return False
    return with_tools != without


def render_chat(tokenizer: Any, messages: Sequence[dict], tools: Sequence[dict] | None,
                tool_choice: Any, parallel_tool_calls: bool | None, *, native: bool) -> str:
    """The prompt text: through the template's own tool rendering when `native`, else the
    fallback format (module docstring). Tools are left out when tool_choice is "none"."""
    shown = tools if call_mode(tools, tool_choice) is not None else None
    if native:
        chat = [_native_message(m) for m in messages]
        kw = {"tools": list(shown)} if shown else {}
        return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, **kw)
    chat = _fallback_messages(messages)
    if shown:
        block = tools_system_block(shown, tool_choice, parallel_tool_calls)
        if chat and chat[0]["role"] == "system":
            chat[0] = {"role": "system", "content": chat[0]["content"] + "\n\n" + block}
        else:
            chat.insert(0, {"role": "system", "content": block})
    return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)


def tools_system_block(tools: Sequence[dict], tool_choice: Any,
                       parallel_tool_calls: bool | None) -> str:
    """The fallback's tool instructions for the system message."""
    lines = ["# Tools", "",
             "You may call functions to help with the user's request. Their signatures, "
             "one JSON object a line, are inside <tools></tools>:", "<tools>"]
    lines += [json.dumps(t, ensure_ascii=False) for t in tools]
    lines += ["</tools>", ""]
    named = _named(tool_choice)
    if call_mode(tools, tool_choice) == "forced":
        which = f"the function {named!r}" if named else "one of these functions"
        lines.append(f"You must call {which}. Reply with the call only, as one JSON object: "
                     '{"name": <function name>, "arguments": <arguments as a JSON object>}')
    else:
        lines.append("To call a function, write a JSON object with its name and arguments "
                     "inside <tool_call></tool_call> tags:")
        lines.append(TOOL_OPEN + "\n" + '{"name": <function name>, "arguments": <arguments as a '
                     "JSON object>}\n" + TOOL_CLOSE)
        if parallel_tool_calls is False:
            lines.append("Call at most one function per reply.")
    return "\n".join(lines)


def _fallback_messages(messages: Sequence[dict]) -> list[dict]:
    """OpenAI messages as plain {role, content} turns a tool-less template renders."""
    out: list[dict] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": True})
            continue
        if role == "assistant" and m.get("tool_calls"):
            calls = [TOOL_OPEN + "\n" + json.dumps({"name": c["function"]["name"],
                                                    "arguments": _arguments(c)},
                                                   ensure_ascii=False) + "\n" + TOOL_CLOSE
                     for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + calls)
        out.append({"role": role, "content": content})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def _native_message(m: dict) -> dict:
    """A message as Hugging Face chat templates take it: arguments as an object, content ""
    rather than None (templates concatenate it)."""
    out = {k: v for k, v in m.items() if v is not None}
    out["content"] = m.get("content") or ""
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": _arguments(c)}} for c in m["tool_calls"]]
    return out


def _arguments(call: dict) -> Any:
    """A past call's arguments as an object when they parse (the client sends them as text)."""
    raw = call["function"].get("arguments", "")
    try:
        return json.loads(raw)
    except (TypeError, ValueError):
        return raw


# ---- the output -----------------------------------------------------------------------------------------
def read_call(text: str, names: Sequence[str]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) if `text` is one call to a declared function, else None.

    >>> read_call(' {"name": "f", "arguments": {"x": 1}} ', ["f"])
    ('f', '{"x": 1}')
    """
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):                       # some models write the arguments as text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def parse_output(text: str, tools: Sequence[dict], mode: Mode, *, parallel: bool = True,
                 new_id: Callable[[], str] = new_call_id) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) from a whole output, the same as `ToolStreamParser` assembles it.

    A block that does not parse as a call to a declared function stays in the content, as
    written. With calls, content is the remaining text without its trailing whitespace, or None
    when nothing but whitespace remains. `parallel=False` keeps the first call only.

    >>> tools = [{"type": "function", "function": {"name": "f"}}]
    >>> parse_output('<tool_call>{"name": "f", "arguments": {}}</tool_call>', tools, "auto",
    ...              new_id=lambda: "call_1")
    (None, [ToolCall(id='call_1', name='f', arguments='{}')])
    """
    p = ToolStreamParser(tools, mode, parallel=parallel, new_id=new_id)
    p.push(text)
    p.finish()
    return p.content, p.calls


class ToolStreamParser:
    """Model text in, chat deltas out: content as it comes, each call once it is complete.

    A call goes out only once it parses (two deltas: index, id, type and name first, then the
    arguments), so a stream never carries a call the non-streamed answer would not have, and an
    agent acts on whole calls anyway. Text that may be the start of `<tool_call>` is held until
    the next text decides, and whitespace before a call until text follows it. In "forced" mode
    the whole output is held: only its end tells whether it was a call.
    """

    def __init__(self, tools: Sequence[dict], mode: Mode, *, parallel: bool = True,
                 new_id: Callable[[], str] = new_call_id) -> None:
        self.names = [t["function"]["name"] for t in tools]
        self.mode = mode
        self.parallel = parallel
        self.new_id = new_id
        self.calls: list[ToolCall] = []
        self._content: list[str] = []         # content released so far
        self._buf = ""                        # text not yet decided
        self._in_call = False                 # inside <tool_call> … (auto mode)
        self._ws = ""                         # whitespace held until text follows it

    @property
    def content(self) -> str | None:
        text = "".join(self._content)
        if not self.calls:
            return text
        return text.rstrip() or None

    def push(self, text: str) -> list[dict]:
        """New model text; returns the deltas it makes ready (maybe none)."""
        self._buf += text
        if self.mode == "forced":
            return []
        out: list[dict] = []
        while True:
            if self._in_call:
                end = self._buf.find(TOOL_CLOSE)
                if end < 0:
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(TOOL_CLOSE):]
                self._in_call = False
                out += self._call_or_text(body, TOOL_OPEN + body + TOOL_CLOSE)
                continue
            start = self._buf.find(TOOL_OPEN)
            if start < 0:
                keep = _partial_suffix(self._buf, TOOL_OPEN)
                out += self._text(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            out += self._text(self._buf[:start])
            self._buf, self._in_call = self._buf[start + len(TOOL_OPEN):], True

    def finish(self) -> list[dict]:
        """The end of the output: what is still held, decided."""
        buf, self._buf = self._buf, ""
        if self.mode == "forced":
            out = self._call_or_text(buf, None)
        elif self._in_call:                   # unclosed: a call only if what came is whole
            self._in_call = False
            out = self._call_or_text(buf, TOOL_OPEN + buf)
        else:
            out = self._text(buf)
        if not self.calls and self._ws:       # no calls: whitespace is content like any text
            out += self._release(self._ws)
            self._ws = ""
        return out

    def _call_or_text(self, body: str, as_text: str | None) -> list[dict]:
        found = read_call(body, self.names)
        if found is None and self.mode == "forced":
            found = _tagged_call(body, self.names)
        if found is None:
            return self._text(body if as_text is None else as_text)
        if self.calls and not self.parallel:
            return []                         # parallel_tool_calls false: the first call only
        call = ToolCall(self.new_id(), *found)
        index = len(self.calls)
        self.calls.append(call)
        return [{"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                 "function": {"name": call.name, "arguments": ""}}]},
                {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]

    def _text(self, text: str) -> list[dict]:
        """Content, with a run of whitespace at its end held until more text follows it."""
        if not text:
            return []
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        return self._release(body) if body else []

    def _release(self, text: str) -> list[dict]:
        self._content.append(text)
        return [{"content": text}]


def _tagged_call(text: str, names: Sequence[str]) -> tuple[str, str] | None:
    """A forced output written as one tagged call (what an unconstrained model may write)."""
    body = text.strip()
    if body.startswith(TOOL_OPEN):
        body = body[len(TOOL_OPEN):]
        if body.endswith(TOOL_CLOSE):
            body = body[:-len(TOOL_CLOSE)]
        return read_call(body, names)
    return None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that `tag` starts with (held until decided)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0
