"""A response's stream events, as a function of its header and its committed tokens.

`EventLog` numbers every event it makes (`sequence_number` from 0) and takes tokens one at a time,
so the events of a response are the same however its tokens arrive: one step's worth at a time on
a live stream, or all at once when a client resumes from the store after a restart. That is what
lets a resumed stream skip exactly the events the client has seen (`starting_after`).

    created, in_progress, output_item.added, content_part.added     (`start`)
    output_text.delta                       one per token whose text completes a piece (`push`)
    output_text.done, content_part.done, output_item.done, and one of completed / incomplete /
    failed (cancelled: incomplete with the status "cancelled")       (`finish`)
"""
from __future__ import annotations

from typing import Any, Sequence

from gateway.responses.objects import Header, Outcome, item_id, message, output_text, response, status
from gateway.text import IncrementalDetokenizer


class EventLog:
    def __init__(self, header: Header, tokenizer: Any, prompt_ids: Sequence[int] = ()) -> None:
        """`prompt_ids`: the request's prompt (its last tokens give the first output token its
        context, as chat completions decodes it)."""
        self.header = header
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.text = ""                 # every delta so far, joined
        self.tokens = 0                # tokens pushed
        self.seq = 0                   # the next event's sequence number
        self.ended = False

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self) -> list[dict[str, Any]]:
        h, rid = self.header, self.header.id
        first = response(h, None, output=False)
        return [self._event("response.created", response=first),
                self._event("response.in_progress", response={**first, "status": "in_progress"}),
                self._event("response.output_item.added", output_index=0,
                            item=message(rid, "", "in_progress")),
                self._event("response.content_part.added", item_id=item_id(rid), output_index=0,
                            content_index=0, part=output_text(""))]

    def push(self, token_ids: Sequence[int]) -> list[dict[str, Any]]:
        out = []
        for t in token_ids:
            self.tokens += 1
            piece = self._detok.push([int(t)])
            if piece:
                out.append(self._delta(piece))
        return out

    def _delta(self, piece: str) -> dict[str, Any]:
        self.text += piece
        return self._event("response.output_text.delta", item_id=item_id(self.header.id),
                           output_index=0, content_index=0, delta=piece, logprobs=[])

    def finish(self, outcome: Outcome) -> list[dict[str, Any]]:
        """The closing events, once the request has ended (`outcome.text` is ignored: the text is
        what the deltas said)."""
        rest = self._detok.flush()
        out = [self._delta(rest)] if rest else []
        o = Outcome(outcome.status, outcome.reason, self.text, outcome.input_tokens,
                    outcome.output_tokens, outcome.ended_at)
        st, rid = status(o), self.header.id
        item = message(rid, self.text, "completed" if st == "completed" else "incomplete")
        out += [self._event("response.output_text.done", item_id=item_id(rid), output_index=0,
                            content_index=0, text=self.text, logprobs=[]),
                self._event("response.content_part.done", item_id=item_id(rid), output_index=0,
                            content_index=0, part=output_text(self.text)),
                self._event("response.output_item.done", output_index=0, item=item)]
        kind = {"completed": "response.completed", "failed": "response.failed"}.get(
            st, "response.incomplete")
        out.append(self._event(kind, response=response(self.header, o)))
        self.ended = True
        return out


def text_of(tokenizer: Any, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> str:
    """A response's output text as its deltas spell it (token by token, then the held rest)."""
    d = IncrementalDetokenizer(tokenizer, prompt_ids)
    return "".join(d.push([int(t)]) for t in token_ids) + d.flush()
