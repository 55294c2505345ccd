"""The one place a Redis client is built, and the bounded ping that says whether Redis answers.

Every client specgate opens (the scheduler's state store, the length learner's, the tenant
registry's, the limiter's, Ray mode's scheduler lease; the state store's subscriber, from
`async_redis_client`) comes from here, so every call
has a socket timeout and a connect timeout: a Redis that accepts connections but never answers
(stopped, swapping, partitioned) costs a caller at most `timeout_s` per call, then
`redis.TimeoutError`, which the gateway answers with 503 and Retry-After
(gateway.errors.STORE_ERRORS). Without them a call waits for the kernel's TCP timeouts: hours.

NOTE: no retries inside the client (`Retry(NoBackoff(), 0)`). A retried EVALSHA whose first try
ran but whose reply was lost would run twice (`RedisStore.add` would then refuse its own request
as a duplicate); callers that can repeat a write safely (the step loop's `StoreWriter`, the grant
keeper's release) retry themselves.
"""
from __future__ import annotations

import threading
import time

import redis
import redis.asyncio
import redis.asyncio.retry
from redis.backoff import NoBackoff
from redis.retry import Retry

# What one Redis call may take before it fails. Steps write a few hundred bytes and the scripts are
# short, so a healthy server answers in well under a millisecond; a second means it is not
# answering, and a request refused after one second keeps its 503 within a client's patience.
REDIS_TIMEOUT_S = 1.0
PROBE_CACHE_S = 1.0          # how long a ping's answer stands for /ready and /metrics


def store_full(exc: BaseException) -> bool:
    """Did Redis refuse a write for want of memory (`maxmemory` reached, `noeviction`)? A command
    or a MULTI/EXEC raises redis-py's OutOfMemoryError; a Lua script's refused command reaches
    redis-py (Redis 6) as a plain ResponseError that quotes Redis's "OOM" error. Reads and
    deletions still go through then: only what adds data is refused."""
    return isinstance(exc, redis.exceptions.OutOfMemoryError) or (
        isinstance(exc, redis.ResponseError) and "OOM command not allowed" in str(exc))


def write_refused(exc: BaseException) -> bool:
    """Does Redis answer but refuse writes for a while: a replica (READONLY, as after a
    failover), a server that cannot persist (MISCONF) or lacks the replicas it must write to
    (NOREPLICAS)? Not full (`store_full`): the store is unavailable for writes until it is fixed."""
    if isinstance(exc, redis.exceptions.ReadOnlyError):
        return True
    return isinstance(exc, redis.ResponseError) and str(exc).startswith(("MISCONF", "NOREPLICAS"))


def redis_client(url: str, timeout_s: float = REDIS_TIMEOUT_S) -> redis.Redis:
    """A redis-py client for `url` ("redis://", "rediss://", "unix://"), connecting on first use,
    every call bounded by `timeout_s` (socket and connect)."""
    if timeout_s <= 0:
        raise ValueError("timeout_s must be > 0")
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                retry=Retry(NoBackoff(), 0))


def async_redis_client(url: str, timeout_s: float = REDIS_TIMEOUT_S) -> redis.asyncio.Redis:
    """`redis_client`'s asyncio twin, for what waits on Redis on an event loop instead of a
    thread (the state store's subscriber, scheduler/store/redis_watch.py): the same timeouts and
    no retries. Use it on one event loop only."""
    if timeout_s <= 0:
        raise ValueError("timeout_s must be > 0")
    return redis.asyncio.Redis.from_url(url, socket_timeout=timeout_s,
                                        socket_connect_timeout=timeout_s,
                                        retry=redis.asyncio.retry.Retry(NoBackoff(), 0))


class StoreProbe:
    """`probe()` -> does Redis answer a PING? Bounded by the client's timeout and cached for
    `cache_s`, so readiness checks and metrics scrapes, however frequent, cost at most one ping a
    `cache_s` and wait at most one timeout; while one caller pings, the others get the last answer
    instead of queueing behind it."""

    def __init__(self, client: redis.Redis, cache_s: float = PROBE_CACHE_S) -> None:
        self._client = client
        self._cache_s = cache_s
        self._lock = threading.Lock()
        self._up = True                  # until the first ping says otherwise
        self._at = float("-inf")

    def __call__(self) -> bool:
        """Ping if the last answer is stale (waits at most the client's timeout); for callers off
        the event loop (/ready runs on a worker thread)."""
        if time.monotonic() - self._at < self._cache_s or not self._lock.acquire(blocking=False):
            return self._up
        try:
            try:
                self._up = bool(self._client.ping())
            except redis.RedisError:
                self._up = False
            self._at = time.monotonic()
            return self._up
        finally:
            self._lock.release()

    def failed(self) -> None:
        """A call elsewhere just timed out or failed: Redis counts as down for a cache time
        (`down_now`), so the requests behind it need not wait a timeout each."""
        self._up, self._at = False, time.monotonic()

    def down_now(self) -> bool:
        """Did a ping or a call fail within the cache time? Never waits, never pings: once that
        is older, the next caller tries Redis itself (and, failing, marks it down again), so a
        Redis that is back is used at once."""
        return not self._up and time.monotonic() - self._at < self._cache_s

    def last(self) -> bool:
        """The last answer, never waiting; a stale one is refreshed on a short-lived thread, for
        callers on the event loop (a /metrics scrape)."""
        if time.monotonic() - self._at >= self._cache_s and not self._lock.locked():
            threading.Thread(target=self, name="specgate-store-probe", daemon=True).start()
        return self._up
