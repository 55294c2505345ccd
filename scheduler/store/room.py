"""Is there room in Redis for new work? `StoreRoom` watches its memory against a watermark.

Redis runs with `maxmemory` and `noeviction` (deploy/): once full it refuses every write that adds
data, the step loop's included, so every tenant's streams would end at once. New work is therefore
refused before that, while Redis's `used_memory` is at or above `watermark` × `maxmemory`: what
lies between the watermark and `maxmemory` is the room the requests already running write their
tokens into until they end (docs/operations.md says how to size it).

`INFO memory` is read at most once a `cache_s` and bounded by the client's timeout, like the
readiness ping (`redis_client.StoreProbe`), so however many requests ask, Redis answers one small
command a second; callers on the event loop get the last answer (`full`), never waiting.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import redis

from scheduler.store.redis_client import PROBE_CACHE_S

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Memory:
    """Redis's memory as `INFO memory` gives it: bytes used, and its limit (0: none)."""
    used: int
    limit: int

    def above(self, watermark: float) -> bool:
        """Is `used` at or above `watermark` of the limit? Never without a limit: then Redis
        refuses nothing, and how much the machine has is not Redis's to say."""
        return self.limit > 0 and self.used >= watermark * self.limit


class StoreRoom:
    """`full()`: is Redis at or above its watermark (module docstring)? Cached for `cache_s`."""

    def __init__(self, client: redis.Redis, watermark: float,
                 cache_s: float = PROBE_CACHE_S) -> None:
        if not 0 < watermark <= 1:
            raise ValueError("watermark must be in (0, 1]")
        self._client = client
        self.watermark = watermark
        self._cache_s = cache_s
        self._lock = threading.Lock()
        self._memory: Memory | None = None     # the last reading; None: none yet, or Redis away
        self._at = float("-inf")

    @property
    def memory(self) -> Memory | None:
        return self._memory

    def read(self) -> bool:
        """Refresh a stale reading (waits at most the client's timeout), then `full()`'s answer:
        for callers off the event loop (/ready runs on a worker thread). While one caller reads,
        the others get the last answer."""
        if time.monotonic() - self._at >= self._cache_s and self._lock.acquire(blocking=False):
            try:
                was = self._is_full()
                self._memory = self._info()
                self._at = time.monotonic()
                if self._is_full() != was:
                    self._report()
            finally:
                self._lock.release()
        return self._is_full()

    def has_room(self) -> bool:
        """`not read()`: a readiness check."""
        return not self.read()

    def has_room_now(self) -> bool:
        """`not full()`: for a metrics scrape, on the event loop."""
        return not self.full()

    def full(self) -> bool:
        """The last answer, never waiting; a stale one is refreshed on a short-lived thread (for
        callers on the event loop: a request's arrival)."""
        if time.monotonic() - self._at >= self._cache_s and not self._lock.locked():
            threading.Thread(target=self.read, name="specgate-store-room", daemon=True).start()
        return self._is_full()

    def _is_full(self) -> bool:
        memory = self._memory
        return memory is not None and memory.above(self.watermark)

    def _report(self) -> None:
        """Once as Redis crosses the watermark, each way: an operator's cue."""
        m = self._memory
        if self._is_full():
            log.warning("Redis uses %d of its %d bytes (watermark %.0f%%): new requests are "
                        "refused (503 store_full) until it has room", m.used, m.limit,
                        100 * self.watermark)
        else:
            log.warning("Redis is below its memory watermark again: new requests are served")

    def _info(self) -> Memory | None:
        """One `INFO memory`; None when Redis does not answer (that is the readiness ping's
        to report: a store that is away is not full)."""
        try:
            info = self._client.info("memory")
        except redis.RedisError as exc:
            log.debug("INFO memory failed: %s", exc)
            return None
        return Memory(int(info.get("used_memory", 0)), int(info.get("maxmemory", 0)))
