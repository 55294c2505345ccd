"""The hostile load test's plain records (what the victim, the /health probe, the sampler and
the attacker observed) and the pure reading of what a gateway answered: error codes from bodies
and stream events, gRPC statuses as REST's.

Every time is `time.monotonic()`: one clock for the runner and the attacker's process
(CLOCK_MONOTONIC is system-wide on Linux), so a record falls into its pattern's window whichever
process made it.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

# error codes that name a server failure when they come as an event inside a 200 stream
SERVER_CODES = frozenset({"internal_error", "server_error", "generation_failed", "overloaded",
                          "queue_full", "store_unavailable"})
# gRPC status name → the REST status the gateway maps to it (docs/api.md, "gRPC"); 0: no answer
GRPC_STATUS = {"OK": 200, "INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401,
               "PERMISSION_DENIED": 403, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429,
               "CANCELLED": 499, "UNAVAILABLE": 503, "INTERNAL": 500, "UNKNOWN": 500,
               "DEADLINE_EXCEEDED": 0}


@dataclass
class Outcome:
    """One attacker request. `status`: HTTP status (gRPC: its REST equivalent), 0 with no answer;
    `code`: the error's `code` (gRPC: the `error-code` metadata), None when none was named;
    `server_error`: a 5xx, or a server failure reported inside a 200 stream; `cut`: the attacker
    hung up itself (its window ended), so an unfinished answer is no fault of the server's."""
    kind: str
    started: float
    ended: float = 0.0
    status: int = 0
    code: str | None = None
    server_error: bool = False
    cut: bool = False
    detail: str | None = None        # what a refusal without a code said (gRPC details)


@dataclass
class VictimSample:
    """One victim request: a short streamed chat. `gaps`: seconds between content deltas."""
    scheduled: float
    max_tokens: int
    started: float = 0.0
    ended: float = 0.0
    status: int = 0
    code: str | None = None
    server_error: bool = False
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int | None = None
    done: bool = False               # `data: [DONE]` arrived
    text: str = ""

    @property
    def complete(self) -> bool:
        """Answered in full: a 200 without an error event, a finish reason, the usage and the
        closing [DONE], and every token it was allowed when it ended by length."""
        if self.status != 200 or self.code is not None or not self.done:
            return False
        if self.finish_reason not in ("stop", "length") or self.completion_tokens is None:
            return False
        return self.finish_reason != "length" or self.completion_tokens == self.max_tokens


@dataclass(frozen=True)
class Probe:
    """One GET /health: when it started, its latency (None: no 200 came back)."""
    t: float
    latency: float | None


@dataclass(frozen=True)
class MemorySample:
    """Redis `used_memory` and the gateway's RSS at time `t` (None where not measured)."""
    t: float
    redis_used_memory: int | None
    rss_bytes: int | None


def error_code(body: bytes) -> str | None:
    """The `error.code` of an OpenAI error body ("unknown" when the body is not one)."""
    try:
        return json.loads(body)["error"]["code"] or "unknown"
    except (ValueError, KeyError, TypeError):
        return "unknown"


def event_error(event: Any) -> tuple[str, bool] | None:
    """(code, is a server failure) of an error event inside a stream, None for any other event:
    chat's `{"error": {...}}` chunk, or the Responses API's `{"type": "error", "code": ...}`."""
    if not isinstance(event, dict):
        return None
    if isinstance(event.get("error"), dict):
        err = event["error"]
        code = err.get("code") or err.get("type") or "stream_error"
        return code, err.get("type") == "server_error" or code in SERVER_CODES
    if event.get("type") == "error":
        code = event.get("code") or "stream_error"
        return code, code in SERVER_CODES
    return None


def sse_data(line: str) -> Any | None:
    """The JSON of one `data:` line of a server-sent event stream; None for other lines, for
    [DONE] and for data that is not JSON."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None


def grpc_outcome(o: Outcome, status_name: str, metadata: dict[str, str], details: str | None) -> None:
    """Fill `o` from a finished gRPC call: its REST status, the `error-code` metadata, and the
    details where no code was named; gRPC's own refusal of an over-cap message names its cap."""
    o.status = GRPC_STATUS.get(status_name, 500)
    if status_name == "OK":
        return
    o.code = metadata.get("error-code") or _grpc_own_cap(status_name, details)
    o.server_error = o.status >= 500
    if o.code is None:
        o.detail = f"grpc {status_name}: {(details or '')[:160]}"


# gRPC refuses a message over the server's receive cap itself, before any servicer could add
# metadata; its details state the cap ("Received message larger than max (N vs. CAP)"), so the
# refusal names its limit as an `error-code` would (docs/api.md, "gRPC").
_GRPC_SIZE_REFUSAL = re.compile(r"received message larger than max \(\d+ vs\. \d+\)", re.IGNORECASE)


def _grpc_own_cap(status_name: str, details: str | None) -> str | None:
    """"max_receive_message_length" for gRPC's own refusal of an over-cap message, else None."""
    if status_name == "RESOURCE_EXHAUSTED" and _GRPC_SIZE_REFUSAL.search(details or ""):
        return "max_receive_message_length"
    return None
