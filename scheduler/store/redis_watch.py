"""Followers of a request kept in Redis wake when its writer commits, in this process or in any
other over the same Redis (an ingress replica following a request its scheduler replica runs).

    writer  `RedisStore.commit_step` publishes, on `P commits`, the ids of the requests a step
            touched, inside the step's own MULTI/EXEC (`add`, inside its script): a subscriber
            that hears an id finds the write in place
    reader  `RedisCommits.watch`: one pub/sub connection per process and event loop (redis-py's
            asyncio client: no thread waits), subscribed while someone there follows a request;
            what it hears wakes the waiters of those ids (scheduler/store/watch.py)

Why one channel per store prefix with the ids in the message, not a channel per request: a
process subscribes once, not once per follower (no SUBSCRIBE round trip before a follower's first
read, and no race between it and the writer), and a step is one PUBLISH, not one per request.
The price: each subscriber hears every commit under its prefix (a few ids per step) and drops
those nobody there follows.

Nothing is missed. A watch is entered only once the subscription is confirmed, and before the
follower's first read. A subscriber that loses its connection fails its waiters (their followers
answer 503 `store_unavailable` within seconds instead of waiting on a Redis that is gone), and
when it subscribes again it wakes every waiter, since what was published meanwhile is lost. A
Redis that stops answering without closing the connection (paused, partitioned) is found by a
PING sent after `HEARTBEAT_S` of silence: unanswered within the client's timeout, the connection
counts as lost.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import redis

from scheduler.store.redis_client import REDIS_TIMEOUT_S, async_redis_client
from scheduler.store.watch import Waiter, Watchers, watching

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0       # silence on the subscription after which it is checked with a PING
RETRY_FIRST_S = 0.05    # after a lost connection, the first wait before subscribing again; doubles
RETRY_MAX_S = 1.0


def channel_of(prefix: str) -> str:
    """Where the writer of the store under `prefix` announces its commits."""
    return prefix + "commits"


def message_of(request_ids: set[str] | list[str]) -> str:
    """What is published for a commit: its request ids, as a JSON list."""
    return json.dumps(sorted(request_ids), separators=(",", ":"))


def _ids(data: Any) -> list[str] | None:
    """The request ids of a published message (`message_of`); None if it is not one."""
    try:
        ids = json.loads(data)
    except (TypeError, ValueError):
        return None
    return ids if isinstance(ids, list) and all(isinstance(i, str) for i in ids) else None


class RedisCommits:
    """The reader's side for one store prefix: `watch(request_id)` as `StateStore.watch` says.
    `pattern`: instead, every store whose commits channel matches this glob (PSUBSCRIBE): a
    reader of several writers' requests (gateway/fleet.py: every replica's) subscribes once."""

    def __init__(self, url: str, prefix: str, timeout_s: float = REDIS_TIMEOUT_S, *,
                 pattern: str | None = None) -> None:
        self.url, self.timeout_s = url, timeout_s
        self.channel = pattern if pattern is not None else channel_of(prefix)
        self.pattern = pattern is not None
        self._subscribers: dict[asyncio.AbstractEventLoop, _Subscriber] = {}

    @asynccontextmanager
    async def watch(self, request_id: str) -> AsyncIterator[Waiter]:
        """A waiter of `request_id`, once this event loop's subscription is confirmed (raises a
        Redis error if it cannot be within the client's timeout and one retry)."""
        loop = asyncio.get_running_loop()
        sub = self._subscribers.get(loop)
        if sub is None:
            sub = self._subscribers[loop] = _Subscriber(self, loop)
        sub.users += 1
        try:
            async with watching(sub.watchers, request_id) as waiter:
                await sub.ready(self.timeout_s + RETRY_MAX_S)
                yield waiter
        finally:
            sub.users -= 1
            if sub.users == 0:                 # nobody here follows anything: unsubscribe
                del self._subscribers[loop]
                sub.stop()


class _Subscriber:
    """One event loop's subscription to the commits channel, and the waiters it wakes."""

    def __init__(self, commits: RedisCommits, loop: asyncio.AbstractEventLoop) -> None:
        self.commits = commits
        self.watchers = Watchers()
        self.users = 0
        self._subscribed = asyncio.Event()
        self._delay = RETRY_FIRST_S
        self._outage_logged = False
        self._task = loop.create_task(self._run(), name="specgate-store-commits")

    async def ready(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._subscribed.wait(), timeout_s)
        except TimeoutError:
            raise redis.TimeoutError("the state store's commit notifications are not "
                                     "subscribed (Redis does not answer)") from None

    def stop(self) -> None:
        self._task.cancel()

    async def _run(self) -> None:
        client = async_redis_client(self.commits.url, self.commits.timeout_s)
        try:
            while True:
                try:
                    await self._listen(client)
                except Exception as exc:       # Redis went away, or stopped answering
                    self._lost(exc)
                await asyncio.sleep(self._delay)
                self._delay = min(2 * self._delay, RETRY_MAX_S)
        finally:
            with contextlib.suppress(RuntimeError):     # its event loop closed with it pending
                await client.aclose()

    async def _listen(self, client: Any) -> None:
        """Subscribe, then hand what is heard to the waiters until the connection is lost."""
        loop = asyncio.get_running_loop()
        timeout_s = self.commits.timeout_s
        async with client.pubsub() as pubsub:
            if self.commits.pattern:
                await pubsub.psubscribe(self.commits.channel)
            else:
                await pubsub.subscribe(self.commits.channel)
            heard, pinged = loop.time(), False
            while True:
                msg = await pubsub.get_message(timeout=HEARTBEAT_S)
                now = loop.time()
                if msg is not None:
                    heard, pinged = now, False
                    self._heard(msg)
                elif not pinged:
                    await pubsub.ping()
                    pinged = True
                elif now - heard > HEARTBEAT_S + timeout_s:
                    raise redis.TimeoutError(f"no answer to a PING within {timeout_s:g}s")

    def _heard(self, msg: dict) -> None:
        kind = msg.get("type")
        if kind in ("message", "pmessage"):
            ids = _ids(msg.get("data"))
            if ids is None:                    # not our writer's: whoever it concerns, reads
                log.warning("an unreadable message on %s", self.commits.channel)
                self.watchers.wake_all()
            else:
                self.watchers.wake(ids)
        elif kind in ("subscribe", "psubscribe"):
            if self._outage_logged:
                log.warning("state store commit notifications resumed")
                self._outage_logged = False
            self._subscribed.set()
            self._delay = RETRY_FIRST_S
            self.watchers.wake_all()           # what was published before this is lost to us

    def _lost(self, exc: Exception) -> None:
        self._subscribed.clear()
        self.watchers.fail_all(lambda: redis.ConnectionError(
            "the state store's commit notifications were lost (Redis does not answer)"))
        if not isinstance(exc, (redis.RedisError, OSError)):
            log.error("state store commit notifications failed", exc_info=exc)
        elif not self._outage_logged:
            log.warning("state store commit notifications lost (%s); followers get 503 until "
                        "Redis answers", exc)
            self._outage_logged = True
