"""What the step loop streams to each request's sink: the tokens a step committed (`Delta`), then
how the request ended (`Finished`). Sinks are called on the loop's thread and must not block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

from scheduler.request import RequestStats, Status
from workers.contract import TokenLogprob


@dataclass(frozen=True)
class Delta:
    """Tokens a step committed for one request, in order (never re-sent), and their logprobs
    when the request asked (`SamplingParams.logprobs`): one entry per token.

    NOTE: logprobs are not persisted with the output: recovery never re-sends committed tokens
    (scheduler/loop.py), so nothing would read them; tokens committed after a recovery have theirs
    (the request's `SamplingParams` are persisted)."""
    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class Finished:
    """The request ended; `stats` is its final record (τ history, attained service, …)."""
    request_id: str
    status: Status
    finish_reason: str | None      # OpenAI finish_reason ("stop", "length", "abort", "error")
    stats: RequestStats
    error: str | None = None       # a message for the client when status is FAILED


Event = Union[Delta, Finished]
Sink = Callable[[Event], None]


class FinishedOnly:
    """A sink told only how its request ended: the loop builds and sends it no `Delta`. For a
    caller that follows every request and none of their tokens (the simulator's summary), a
    `Delta` per request per step would be work for nothing."""
    __slots__ = ("on_finished",)

    def __init__(self, on_finished: Callable[[Finished], None]) -> None:
        self.on_finished = on_finished

    def __call__(self, event: Event) -> None:
        if isinstance(event, Finished):
            self.on_finished(event)
