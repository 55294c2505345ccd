"""The stream: one admitted request's events, bridged from the step loop's thread into the
consumer's event loop, through the incremental detokenizer and the stop-string matcher.

`RequestStream.sink` runs on the loop's thread and only posts events (`call_soon_threadsafe`);
everything else runs on the consumer's event loop. A stop string ends the request early (the
loop cancels it as finished); closing the stream before the end cancels it, unless it is
detached, in which case it is handed to `adopt` and runs to its end. A concurrency grant is
released, on the grant keeper's thread, however the request ends.

Backpressure: the consumer pulls one event at a time, and a writer whose client does not read
stops pulling (uvicorn's `send`, gRPC's `write`, wait while the connection's buffers are full).
The tokens the sink has posted and the consumer not yet pulled are the stream's backlog; past
`Backlog.pause_tokens` the request is paused in the scheduler (scheduler/policies/pauses.py: not
planned, its KV freed), and once the consumer has drained it to `Backlog.resume_tokens` it is
resumed with its place. Nothing is lost: every token generated is in the queue, in order. A
detached stream (a background or resumable response) is never paused: it runs whether or not
anyone reads, and its followers read it from the state store.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence

from gateway.metrics import GatewayMetrics
from gateway.service.types import (GenerateOutput, Prepared, SpecStats, StreamChunk,
                                   TokenLogprobs)
from gateway.tenancy.grants import GrantKeeper
from gateway.tenancy.limits import Grant
from gateway.text import IncrementalDetokenizer, OutputText, token_piece
from scheduler.loop import Delta, Finished, StepLoop
from scheduler.request import Status
from workers.contract import TokenLogprob

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backlog:
    """A stream's bounds on tokens generated and not yet pulled by its writer (module
    docstring): paused past `pause_tokens` (0: never), resumed at `resume_tokens` or fewer."""
    pause_tokens: int = 256
    resume_tokens: int = 64

    def __post_init__(self) -> None:
        if self.pause_tokens and not 0 <= self.resume_tokens < self.pause_tokens:
            raise ValueError("a stream resumes below the backlog it pauses at: "
                             f"0 <= resume_tokens < pause_tokens, got {self.resume_tokens} "
                             f"and {self.pause_tokens}")


@dataclass(frozen=True)
class StreamParts:
    """What every stream of one service shares: the step loop (whose `cancel` ends a request,
    and `pause` holds one whose reader fell behind), `adopt(stream)`, which runs a detached stream
    on with nobody listening (the event loop's), and the backlog bounds."""
    tokenizer: Any
    metrics: GatewayMetrics
    grants: GrantKeeper | None
    step_loop: StepLoop
    adopt: Callable[["RequestStream"], None]
    backlog: Backlog = Backlog()


class RequestStream:
    """One admitted request's events as an async iterator: `StreamChunk`s, then one
    `GenerateOutput`. `aclose()` (or dropping it) before the end cancels the request, unless it
    is detached: then it is adopted (`StreamParts.adopt`) and runs to its end."""

    def __init__(self, parts: StreamParts, prep: Prepared, grant: Grant | None,
                 aio: asyncio.AbstractEventLoop, t0: float) -> None:
        self.parts = parts
        self.prep = prep
        self.request_id = prep.request.request_id
        self.grant = grant
        self.admitted = False
        self._aio = aio
        self._queue: asyncio.Queue = asyncio.Queue()
        self._t0 = t0
        self._last_t: float | None = None
        req = prep.request
        self._times = parts.metrics.times(req.stats.tenant, req.stats.tier, prep.predicted_ttft_s,
                                          req.stats.prompt_len,
                                          parts.step_loop.policy.config.step_cost)
        self._text = OutputText(parts.tokenizer, req.prompt_ids, prep.stops)
        self._ids: list[int] = []
        self._pending_ids: list[int] = []
        self._out: collections.deque = collections.deque()
        # logprobs, when asked for: each token's entry, with the offset of its text, found by a
        # detokenizer of their own fed one token at a time
        self._logprobs = LogprobTrack(parts.tokenizer, req.prompt_ids) \
            if req.sampling.logprobs is not None else None
        self._ended = False          # the Finished event was handled (or the stream was closed)
        self._closed = False
        self._detached = bool(req.meta.get("detached"))
        self._adopted = False        # detached, and handed on when closed early
        # backlog (module docstring): tokens posted by the sink and pulled by the consumer, and
        # whether the request is paused; the lock orders each pause before its resume
        self._pause_at = 0 if self._detached else parts.backlog.pause_tokens
        self._posted = self._pulled = 0
        self._paused = False
        self._hold = threading.Lock()

    @property
    def service_tier(self) -> str:
        """The tier it runs in (admission may have moved it to flex, gateway/service/admission.py)."""
        return self.prep.request.stats.tier

    # ---- the loop's thread ----------------------------------------------------------------------
    def sink(self, event: Delta | Finished) -> None:
        if isinstance(event, Finished):
            drafter = self.prep.request.drafter or "default"
            self.parts.metrics.request_stats(event.stats, drafter)
        if self._closed:
            return
        try:
            self._aio.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:                           # the event loop is gone: nobody listens
            self._closed = True
            return
        if self._pause_at and isinstance(event, Delta):
            with self._hold:
                self._posted += len(event.token_ids)
                if not self._paused and self._posted - self._pulled >= self._pause_at:
                    self._paused = True
                    self.parts.step_loop.pause(self.request_id)
                    self.parts.metrics.stream_paused.inc()

    # ---- the consumer's event loop ------------------------------------------------------------------
    def __aiter__(self) -> AsyncIterator[StreamChunk | GenerateOutput]:
        return self

    async def __anext__(self) -> StreamChunk | GenerateOutput:
        while not self._out:
            if self._ended:
                raise StopAsyncIteration
            event = await self._queue.get()
            if isinstance(event, Delta):
                if self._pause_at:
                    self._pulled_(len(event.token_ids))
                self._on_delta(event)
            else:
                settled = self._on_finished(event)
                if settled is not None and not settled.done():      # done: released inline
                    # the slot is free before the client hears the end: its next request fits
                    await asyncio.shield(asyncio.wrap_future(settled))
        return self._out.popleft()

    def _pulled_(self, n: int) -> None:
        """The writer took `n` more tokens: resume the request once its backlog has drained."""
        with self._hold:
            self._pulled += n
            if self._paused and self._posted - self._pulled <= self.parts.backlog.resume_tokens:
                self._paused = False
                if not self._ended:
                    self.parts.step_loop.pause(self.request_id, False)

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening; cancel the request if it has not ended (idempotent). Never waits: the
        grant's release runs on the grant keeper's thread."""
        if self._closed:
            return
        if self._detached and self.admitted and not self._ended and not self._adopted:
            self._adopted = True     # nobody listens any more; it runs on (a second close cancels)
            try:
                self.parts.adopt(self)
                return
            except RuntimeError:     # no running event loop (collected late): cancel it below
                pass
        self._closed = True
        if self.admitted and not self._ended:
            self._ended = True
            self.parts.step_loop.cancel(self.request_id)
            self._settle("cancelled")

    def __del__(self) -> None:                         # never iterated nor closed: do not leak it
        try:
            self.close()
        except Exception:
            pass

    def _on_delta(self, event: Delta) -> None:
        if self._text.stopped:
            return                                     # committed past a stop string: not shown
        now = time.perf_counter()
        if self._last_t is None:
            self._times.first_token(now - self._t0)
        else:
            self._times.tokens(now - self._last_t, len(event.token_ids))
        self._last_t = now
        # token by token (gateway/text.py `OutputText`): the tokens after a stop string are cut
        text, taken = self._text.push(event.token_ids)
        ids = event.token_ids[:taken]
        self._ids.extend(ids)
        self._pending_ids.extend(ids)
        if self._logprobs is not None and event.logprobs is not None:
            self._logprobs.add(ids, event.logprobs[:taken])
        if self._text.stopped:
            self.parts.step_loop.cancel(self.request_id, status=Status.FINISHED, cause="stop_string")
        self._emit(text)

    def _on_finished(self, event: Finished) -> concurrent.futures.Future | None:
        stopped = self._text.stopped
        self._emit(self._text.finish(), final=not stopped)
        reason = "stop" if stopped else (event.finish_reason or "error")
        if event.status is Status.FAILED:
            log.warning("request %s failed: %s", self.request_id, event.error)
            reason = "error"
        self._ended = True
        settled = self._settle({"stop": "finished", "length": "finished", "abort": "cancelled"}
                               .get(reason, "failed"))
        self._out.append(GenerateOutput(
            self.request_id, self._text.text, tuple(self._ids), reason,
            self.prep.request.stats.prompt_len, len(self._ids), SpecStats.of(event.stats),
            self._logprobs.sent if self._logprobs is not None else None,
            service_tier=self.prep.request.stats.tier))
        return settled

    def _emit(self, text: str, *, final: bool = False) -> None:
        """A chunk of new text, with the logprobs of the tokens whose text now shows (`final`:
        the generation ended without a stop string, so every token's go out, those without
        text, such as a stop token, included)."""
        lps = None
        if self._logprobs is not None:
            lps = self._logprobs.take(None if final else self._text.chars)
        if text or lps:
            self._out.append(StreamChunk(text, tuple(self._pending_ids), lps))
            self._pending_ids.clear()

    def _settle(self, status: str) -> concurrent.futures.Future | None:
        """Count the request's end and release its grant (on the keeper's thread when the
        limiter is remote); the release's future, or None without a grant."""
        s = self.prep.request.stats
        settled = None
        if self.parts.grants is not None and self.grant is not None:
            try:
                settled = self.parts.grants.release(self.grant, s.prompt_len + len(self._ids))
            except Exception:                          # a memory limiter's bug: log, go on
                log.exception("limiter release failed for %s", self.request_id)
            self.grant = None
        lived = time.perf_counter() - self._t0
        self.parts.metrics.done(s.tenant, status, lived, len(self._ids))
        self._times.ended(lived)
        return settled


class LogprobTrack:
    """A request's logprob entries as its tokens commit, and which have gone out: an entry goes
    out once the text shown reaches past where its token's text starts, so a token cut by a stop
    string never shows (its text is not shown either)."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._pieces: dict[int, tuple[str, tuple[int, ...]]] = {}
        self._held: collections.deque = collections.deque()
        self._sent: list[TokenLogprobs] = []

    def add(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob]) -> None:
        for tok, (lp, top) in zip(token_ids, logprobs):
            offset = self._detok.chars
            self._detok.push([tok])
            text, raw = self._piece(tok)
            self._held.append(TokenLogprobs(text, raw, _finite(lp), tuple(
                (*self._piece(t), _finite(v)) for t, v in top), offset))

    def take(self, shown: int | None) -> tuple[TokenLogprobs, ...]:
        """The held entries whose text starts before character `shown` (None: all of them)."""
        out = []
        while self._held and (shown is None or self._held[0].offset < shown):
            out.append(self._held.popleft())
        self._sent += out
        return tuple(out)

    @property
    def sent(self) -> tuple[TokenLogprobs, ...]:
        return tuple(self._sent)

    def _piece(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = token_piece(self.tokenizer, token_id)
        return piece


def _finite(logprob: float) -> float:
    """JSON has no -inf: a token the model rules out entirely shows as -9999 (as vLLM does)."""
    return max(float(logprob), -9999.0)
