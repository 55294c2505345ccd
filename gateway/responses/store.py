"""Stored responses: each one's owner and what it asked (`Header`), and once it has ended its
final output, kept for `ttl_s` from its creation, then gone (a GET is a 404, as for an id never
made). In memory (the embedded default) or in Redis under the shared prefix, so that any gateway
replica, or a restarted one, can answer for any response:

    P resp:ID   hash   header   JSON: the Header (its tenant id included)
                       final    JSON: status, reason, text, output_ids, context, input_tokens,
                                ended_at; written once the request has ended (`finalize`)

The request's tokens, while it runs, are the scheduler's (its state store, `StateStore.tail`):
a final copy is kept here because the scheduler's record of an ended request expires sooner.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from gateway.responses.objects import Header
from scheduler.store.redis_client import redis_client


@dataclass(frozen=True)
class Stored:
    header: Header
    final: dict[str, Any] | None        # None: not ended (or not finalized yet)


class ResponseStore(Protocol):
    remote: bool

    def put(self, header: Header) -> bool:
        """Keep a new response for the store's TTL; False if its id is taken."""

    def get(self, response_id: str) -> Stored | None:
        """A response that has not expired, whoever owns it (callers check `tenant_id`)."""

    def finalize(self, response_id: str, final: dict[str, Any]) -> bool:
        """Keep an ended response's output (idempotent); False if it is gone (expired,
        deleted): a final is never written without its header."""

    def delete(self, response_id: str) -> bool:
        """Forget a response; False if there was none."""


class MemoryResponses:
    remote = False

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._held: dict[str, tuple[Header, dict | None, float]] = {}
        self._lock = threading.Lock()

    def put(self, header: Header) -> bool:
        with self._lock:
            self._expire()
            if header.id in self._held:
                return False
            self._held[header.id] = (header, None, self._clock() + self.ttl_s)
            return True

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            self._expire()
            held = self._held.get(response_id)
            return None if held is None else Stored(held[0], json.loads(json.dumps(held[1]))
                                                    if held[1] is not None else None)

    def finalize(self, response_id: str, final: dict[str, Any]) -> bool:
        with self._lock:
            self._expire()
            held = self._held.get(response_id)
            if held is None:
                return False
            self._held[response_id] = (held[0], json.loads(json.dumps(final)), held[2])
            return True

    def delete(self, response_id: str) -> bool:
        with self._lock:
            self._expire()
            return self._held.pop(response_id, None) is not None

    def _expire(self) -> None:
        now = self._clock()
        for rid in [r for r, (_, _, t) in self._held.items() if t <= now]:
            del self._held[rid]


# KEYS: the response's key.  ARGV: final (JSON). Writes only into a live key, so that a late final
# never recreates an expired or deleted response (without a TTL, for ever).
_FINALIZE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'final', ARGV[1])
return 1
"""


# KEYS: the response's key.  ARGV: header (JSON), TTL in ms.  1 if created, 0 if the id is taken.
_PUT_LUA = """
if redis.call('HSETNX', KEYS[1], 'header', ARGV[1]) == 0 then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""


class RedisResponses:
    remote = True

    def __init__(self, client: Any, prefix: str, ttl_s: float) -> None:
        self._r = client
        self._prefix = prefix + "resp:"
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self._finalize = client.register_script(_FINALIZE_LUA)
        self._put = client.register_script(_PUT_LUA)

    def put(self, header: Header) -> bool:
        return bool(self._put(keys=[self._prefix + header.id],
                              args=[json.dumps(header.to_dict(), separators=(",", ":")), self.ttl_ms]))

    def get(self, response_id: str) -> Stored | None:
        header, final = self._r.hmget(self._prefix + response_id, "header", "final")
        if header is None:
            return None
        return Stored(Header.from_dict(json.loads(header)), json.loads(final) if final else None)

    def finalize(self, response_id: str, final: dict[str, Any]) -> bool:
        return bool(self._finalize(keys=[self._prefix + response_id],
                                   args=[json.dumps(final, separators=(",", ":"))]))

    def delete(self, response_id: str) -> bool:
        return bool(self._r.delete(self._prefix + response_id))


def open_responses(redis_url: str | None, prefix: str, ttl_s: float, timeout_s: float) -> ResponseStore:
    if not redis_url or redis_url == "memory://":
        return MemoryResponses(ttl_s)
    return RedisResponses(redis_client(redis_url, timeout_s), prefix, ttl_s)
