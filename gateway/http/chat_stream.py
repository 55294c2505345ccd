"""A chat completion stream's events, live or resumed: the `chat.completion.chunk`s, their SSE
ids, and what the request's record keeps so that a resume renders them again.

Ids (specgate extension; n = 1, no tool parsing, no logprobs):

    "0"        the opening chunk (role "assistant")
    "<c>"      a content chunk: c = the characters (Unicode code points) of content shown once it
               is read. The text shown after k tokens depends on those tokens alone
               (gateway/text.py `OutputText`), so an id means the same text however the steps
               grouped the tokens, and a resume sends exactly text[c:]
    "end"      the final chunk (finish_reason, specgate's speculation figures)
    "usage"    the usage chunk (stream_options.include_usage)

A stream with tools (its text is parsed into calls), logprobs or n > 1 carries no ids and cannot
be resumed: its record says why (`refusal`), and the resume endpoint answers 400 with it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway import errors
from gateway.http import bodies
from gateway.replay import Cursor
from gateway.service import GenerateOutput, StreamChunk
from scheduler.tiers import DEFAULT_TIER


def refusal(n: int, tool_parsing: bool, logprobs: bool) -> str | None:
    """Why a chat stream cannot be resumed (None: it can)."""
    if n > 1:
        return "a stream of n > 1 choices cannot be resumed"
    if tool_parsing:
        return "a stream with tools cannot be resumed"
    if logprobs:
        return "a stream with logprobs cannot be resumed"
    return None


@dataclass(frozen=True)
class ChatView:
    """What a chat stream's chunks show besides the text, kept with the request's record
    (`Request.meta["chat"]`) so that a resumed stream's chunks are the live ones'."""
    model: str
    created: int
    usage: bool                          # stream_options.include_usage
    refusal: str | None = None           # why it cannot be resumed; None: it can
    service_tier: str = DEFAULT_TIER     # the tier it runs in, in every chunk

    def to_meta(self) -> dict[str, Any]:
        return {"chat": {"model": self.model, "created": self.created, "usage": self.usage,
                         "refusal": self.refusal, "service_tier": self.service_tier}}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> "ChatView | None":
        chat = meta.get("chat")
        if not isinstance(chat, dict):
            return None                  # not a chat completion stream
        return cls(str(chat["model"]), int(chat["created"]), bool(chat["usage"]), chat.get("refusal"),
                   str(chat.get("service_tier") or DEFAULT_TIER))   # kept before tiers: default


class ChatChunks:
    """The chunks of one chat stream (`rid`), for `gateway.http.deps.sse_events`; `skip_final`:
    a resumed stream whose client has the final chunk already."""

    def __init__(self, view: ChatView, rid: str, parsers: list, *, skip_final: bool = False) -> None:
        self.view, self.rid, self.parsers, self.skip_final = view, rid, parsers, skip_final

    def event(self, i: int, delta: dict, finish_reason: str | None = None, logprobs=None) -> dict:
        v = self.view
        extra = {"usage": None} if v.usage else {}
        return {**bodies.chat_chunk(self.rid, v.model, v.created, delta, finish_reason, index=i,
                                     service_tier=v.service_tier, logprobs=logprobs), **extra}

    def openings(self) -> list[dict]:
        return [self.event(i, {"role": "assistant", "content": ""}) for i in range(len(self.parsers))]

    def chunk(self, i: int, piece: StreamChunk) -> list[dict]:
        parser = self.parsers[i]
        deltas = [{"content": piece.text}] if parser is None else parser.push(piece.text)
        if not deltas and piece.logprobs:     # text held by the tool parser: its logprobs go now
            deltas = [{}]
        return [self.event(i, d, logprobs=piece.logprobs if k == 0 else None)
                for k, d in enumerate(deltas)]

    def final(self, i: int, out: GenerateOutput) -> list[dict]:
        if self.skip_final:
            return []
        parser = self.parsers[i]
        held = [] if parser is None else [self.event(i, d) for d in parser.finish()]
        return held + [{**self.event(i, {}, bodies.finish_reason(out.finish_reason, parser)),
                        "specgate": bodies.spec_stats([out])}]

    def usage(self, outs: list[GenerateOutput]) -> dict:
        return {"id": self.rid, "object": "chat.completion.chunk", "created": self.view.created,
                "model": self.view.model, "service_tier": self.view.service_tier, "choices": [],
                "usage": bodies.usage(outs)}


class ChatIds:
    """The SSE ids above (`gateway.http.deps.EventIds`), counting from `chars` characters (a
    resumed stream starts where its client was)."""

    def __init__(self, chars: int = 0) -> None:
        self.chars = chars

    def opening(self, i: int) -> str:
        return "0"

    def chunk(self, i: int, piece: StreamChunk) -> str:
        self.chars += len(piece.text)
        return str(self.chars)

    def final(self, i: int) -> str:
        return "end"

    def usage(self) -> str:
        return "usage"


@dataclass(frozen=True)
class Resume:
    """Where a resumed chat stream starts, from a `Last-Event-ID` (None: from the start)."""
    cursor: Cursor
    opening: bool = True       # send the opening chunk
    final: bool = True         # send the final chunk
    usage: bool = True         # send the usage chunk (if the request asked for it)


def resume_from(last_event_id: str | None) -> Resume:
    """The `Last-Event-ID` a client sends back (or `?after=`): 400 unless it is one of ours.

    >>> resume_from("12").cursor.chars, resume_from("end").final, resume_from(None).opening
    (12, False, True)
    """
    if last_event_id is None:
        return Resume(Cursor())
    v = last_event_id.strip()
    if v.isascii() and v.isdigit() and len(v) <= 12:
        return Resume(Cursor(chars=int(v)), opening=False)
    if v == "end":
        return Resume(Cursor(chars=2**62), opening=False, final=False)
    if v == "usage":
        return Resume(Cursor(chars=2**62), opening=False, final=False, usage=False)
    raise errors.invalid(f"Last-Event-ID must be an id this stream sent (a number of characters, "
                         f"'end' or 'usage'), got {last_event_id[:40]!r}", "Last-Event-ID")
